"""The process-wide model: one frozen backbone per process, shared by the clients that run in it (each swaps its
adapter states in and out), the round-0 adapter weights, and the disk cache of the frozen prefix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from pipeline.common.config import check_lengths, repo_root
from pipeline.experiments.plans import Plan
from pipeline.experiments.settings import CacheConfig
from pipeline.modeling.cache import PrefixCache
from pipeline.modeling.model import AdapterSummarizer, adapter_config
from pipeline.training.seeds import derived_seed

_MODELS: dict[tuple, AdapterSummarizer] = {}
_INITIAL_STATES: dict[tuple, dict[str, torch.Tensor]] = {}
_PREFIX_CACHES: dict[tuple, PrefixCache] = {}


def _model_key(plan: Plan) -> tuple:
    """What the shared model depends on: the backbone and the whole adapter configuration (init std included)."""
    return (str(Path(plan.paths["backbone"]).resolve()), dataclasses.astuple(adapter_config(plan.model_config)))


def shared_model(plan: Plan) -> AdapterSummarizer:
    """One frozen backbone per process (clients take turns on it, each loading its adapter states first)."""
    key = _model_key(plan)
    if key not in _MODELS:
        backbone = Path(plan.paths["backbone"])
        if not backbone.exists():
            raise FileNotFoundError(f"{backbone}: backbone not found (stage `backbone`)")
        _MODELS.clear()  # a process trains one backbone at a time; free the previous one
        _MODELS[key] = AdapterSummarizer.from_pretrained(backbone, adapter_config(plan.model_config))
    check_lengths(_MODELS[key].backbone, plan.model_config.max_source_length, plan.model_config.max_target_length)
    return _MODELS[key]


def initial_adapter_state(plan: Plan) -> dict[str, torch.Tensor]:
    """Round-0 adapter weights, a function of the experiment seed only (drawn from their own seeded generator)."""
    model = shared_model(plan)
    key = (_model_key(plan), plan.seed)
    if key not in _INITIAL_STATES:
        _INITIAL_STATES[key] = model.fresh_adapter_state(derived_seed(plan.seed, "adapter-init"))
    return {k: v.clone() for k, v in _INITIAL_STATES[key].items()}


def prefix_cache_for(plan: Plan, model: AdapterSummarizer, cache: CacheConfig):
    """The disk cache of the frozen prefix (encoder + lower decoder layers), one per process and configuration (its
    entries stay resident on the model's device once read), or None when disabled."""
    if not plan.train.prefix_cache:
        return None
    # where it lives and its budget are run-time settings (RunSettings.cache); its entries' dtype is the plan's
    args = (
        repo_root() / cache.cache_dir,  # a relative model.cache_dir under the project root, an absolute one as given
        model.backbone_fingerprint,
        plan.model_config,
        plan.cache_dtype or "float32",
        int(cache.cache_max_gb * 2**30),
    )
    if (id(model), *args) not in _PREFIX_CACHES:
        _PREFIX_CACHES.clear()  # one model per process (shared_model): the previous one's entries go
        _PREFIX_CACHES[(id(model), *args)] = PrefixCache(*args)
    return _PREFIX_CACHES[(id(model), *args)]
