"""Server strategies, one module each, registered where they are defined (registry.register_strategy); catalog
imports them all and looks one up by name."""
