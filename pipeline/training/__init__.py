"""Local training of one client, the methods' registry, DP-SGD."""
