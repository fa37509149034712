"""Differential privacy and secure aggregation of what a client sends (docs/privacy.md); entry: privacy.seam."""
