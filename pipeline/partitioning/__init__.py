"""Partition schemes: which client gets which examples."""
