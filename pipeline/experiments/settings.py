"""Run-time settings (:class:`RunSettings`): how a run executes, never what it computes, so they stay out of plans
(docs/ARCHITECTURE.md, "Experiments, plans and run-time settings")."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from pathlib import Path
from typing import Any

from pydantic import field_validator

from pipeline.common.config import NonNegative, Positive, config, from_dict, group, load_params


@config(frozen=True)
class CacheConfig:
    """Where the prefix cache lives and what the caches may hold; no result depends on it, so plans leave it out
    (RunSettings below; the entries' dtype, which does, travels in the plan)."""

    cache_dir: str = "data/cache/prefix"
    cache_max_gb: NonNegative = 4.0

    @field_validator("cache_dir")
    @classmethod
    def _names_a_folder(cls, value: str) -> str:
        if not value.strip():  # the project root itself, where the cache's entries and its pruning would then go
            raise ValueError("is empty or blank: no folder (a relative one is under the project root)")
        return value


@config
class RunSettings:
    """params `train.round_timeout_s`/`admission_timeout_s` and the cache budgets of `model`: how a run executes,
    never what it computes; no DVC stage declares them (tests/test_experiments.py)."""

    round_timeout_s: Positive = 1800.0
    admission_timeout_s: Positive = 600.0
    cache: CacheConfig = field(default_factory=CacheConfig)


# The `train` and `model` keys of RunSettings. cache_dtype is not among them: a float16 prefix changes the logits.
RUN_TRAIN_KEYS = tuple(f.name for f in dataclasses.fields(RunSettings) if f.name != "cache")
RUN_MODEL_KEYS = tuple(f.name for f in dataclasses.fields(CacheConfig))


def check_run_keys(values: dict[str, Any], where: str) -> RunSettings:
    """The run-time keys of ``values`` (a `train` group, an entry) as RunSettings; a bad one named ``where.key``."""
    return from_dict(RunSettings, {k: v for k, v in values.items() if k in RUN_TRAIN_KEYS}, where)


def load_run_settings(params_path: str | Path, experiment: str | None = None) -> RunSettings:
    """The run-time settings of the params file a stage entry point names (the train stage: the project's; the
    federation commands: their ``--params``; a missing file is an error, load_params', never the defaults), with
    ``experiment``'s own overrides of them (e.g. ``round_timeout_s``; a bad one is named as the entry's: ``<file>
    experiments.<name>.round_timeout_s``)."""
    params, file = load_params(params_path), str(params_path)
    own = group(group(params, "experiments", file), experiment, f"{file} experiments") if experiment is not None else {}
    check_run_keys(own, f"{file} experiments.{experiment}")
    model = group(params, "model", file)
    cache = from_dict(CacheConfig, {k: model[k] for k in RUN_MODEL_KEYS if k in model}, f"{file} model")
    return dataclasses.replace(check_run_keys(group(params, "train", file) | own, f"{file} train"), cache=cache)
