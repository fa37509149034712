"""Differential privacy and secure aggregation of what a client sends (params `privacy`, README "Privacy"):
settings (the params group, refusals), accounting (opacus' accountants; a client's and a federation's resolved
setting), example_dp (DP-SGD of the local training, mode example), client_dp (Flower's DP strategy wrappers and
clipping mods, mode client), secure_aggregation (SecAgg+). Other modules reach it through pipeline.privacy.seam."""
