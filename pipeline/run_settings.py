"""Run-time settings: how a run executes, never what it computes (the engine, Ray resources, the round and
admission timeouts, where the prefix cache lives and how large it and the teacher cache may grow). A stage entry
point builds them once from the params file it names (:func:`load_run_settings`) and passes them down; they stay out
of plans, so changing one reruns no train stage and resumes the same checkpoint (tests/test_experiments.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

from pipeline.common.config import Positive, config, from_dict, group, load_params
from pipeline.modeling.cache import CacheConfig

# `train` keys that decide how a run is executed, never what it computes (RunSettings); `model` keys likewise
# (CacheConfig). cache_dtype is not among them: a float16 prefix changes the logits.
RUN_TRAIN_KEYS = ("engine", "ray_cpus_per_client", "ray_gpus_per_client", "round_timeout_s", "admission_timeout_s")
RUN_MODEL_KEYS = tuple(f.name for f in dataclasses.fields(CacheConfig))


@config
class RunSettings:
    """params `train.engine`, `train.ray_*`, `train.round_timeout_s`/`admission_timeout_s` and the cache budgets of `model`
    (comments in the params file). Built by a stage entry point when a run starts (:func:`load_run_settings`) and passed
    down; no DVC stage declares them, so changing one reruns nothing (tests/test_experiments.py)."""

    engine: Literal["inprocess", "ray"] = "inprocess"
    ray_cpus_per_client: float = 1.0
    ray_gpus_per_client: float = 0.0
    round_timeout_s: Positive = 1800.0
    admission_timeout_s: Positive = 600.0
    cache: CacheConfig = field(default_factory=CacheConfig)


def run_settings(params: dict[str, Any], experiment: str | None = None) -> RunSettings:
    """The run-time settings of the params file, with ``experiment``'s own overrides of them (e.g. ``engine: ray``)."""
    train = dict(group(params, "train"))
    if experiment is not None:
        train.update((params.get("experiments") or {}).get(experiment) or {})
    model = group(params, "model")
    return from_dict(RunSettings, {**{k: train[k] for k in RUN_TRAIN_KEYS if k in train},
                                   "cache": from_dict(CacheConfig, {k: model[k] for k in RUN_MODEL_KEYS if k in model},
                                                      "params.yaml model")}, "params.yaml train")


def load_run_settings(params_path: str | Path, experiment: str | None = None) -> RunSettings:
    """:func:`run_settings` of the params file a stage entry point names (the train stage: the project's; the
    federation commands: their ``--params``), read once per run. A missing file is an error, never the
    defaults."""
    if not Path(params_path).exists():
        raise FileNotFoundError(f"{params_path}: params file not found (the run-time settings: engine, round "
                                f"timeout, cache location and budgets)")
    return run_settings(load_params(params_path), experiment)
