"""Differential privacy and secure aggregation of what a client sends (params `privacy`, docs/privacy.md): settings,
accounting, example_dp (mode example), client_dp (mode client), secure_aggregation (SecAgg+); other modules reach
it through pipeline.privacy.seam."""
