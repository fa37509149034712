"""The ``model`` params group's keys that shape the model: a plan carries them (the cache's: settings.CacheConfig)."""

from __future__ import annotations

import dataclasses

from pipeline.common.config import NonNegative, PositiveInt, TokenLength, config, from_dict


@config(frozen=True)
class ModelConfig:
    # top_k's upper bound (the backbone's decoder layers) is checked when the model is built.
    top_k: PositiveInt = 2
    bottleneck: PositiveInt = 768
    adapter_bias: bool = True
    adapter_init_std: NonNegative = 0.02  # torch.nn.init.normal_ refuses std < 0 (and NaN)
    max_source_length: TokenLength = 512
    max_target_length: TokenLength = 96

    @classmethod
    def from_group(cls, group: dict | None, where: str = "model") -> ModelConfig:
        """From the `model` params group, leaving out its cache keys (pipeline.experiments checks those)."""
        return from_dict(cls, {k: v for k, v in (group or {}).items() if k in MODEL_RESULT_KEYS}, where)


MODEL_RESULT_KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig))
