"""Scoring, statistics, comparisons, published numbers, human evaluation, MLflow tracking."""
