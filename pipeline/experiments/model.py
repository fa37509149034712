"""The ``model`` params group's keys that shape the model: a plan carries them (the cache's: settings.CacheConfig)."""

from __future__ import annotations

import dataclasses

from pipeline.common.config import NonNegative, PositiveInt, TokenLength, config


@config(frozen=True)
class ModelConfig:
    # top_k's upper bound (the backbone's decoder layers) is checked when the model is built.
    top_k: PositiveInt = 2
    bottleneck: PositiveInt = 768
    adapter_bias: bool = True
    adapter_init_std: NonNegative = 0.02  # torch.nn.init.normal_ refuses std < 0 (and NaN)
    max_source_length: TokenLength = 512
    max_target_length: TokenLength = 96


MODEL_RESULT_KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig))
