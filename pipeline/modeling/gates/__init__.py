"""KD gates, one module each, registered where they are defined (registry.register_gate); catalog imports them all."""
