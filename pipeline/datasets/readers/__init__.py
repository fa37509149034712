"""Dataset readers, one module per upstream layout, each registering itself and where its files come from
(registry.register_reader); catalog imports them all."""
