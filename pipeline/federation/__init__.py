"""Flower apps, strategies, adapter transfer, engines and the local deployment."""
