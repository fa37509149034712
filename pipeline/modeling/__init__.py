"""The frozen backbone with adapters, its batches, the prefix cache and the losses."""
