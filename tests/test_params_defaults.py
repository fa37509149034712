"""Defaults live in one place: params.yaml. Every default of a config dataclass equals params.yaml's value for
that key (nested groups included), so code or a test that builds a config without params.yaml runs what
`make repro` runs, and a value changed in params.yaml alone cannot silently disagree with the code's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipeline.common.config import load_params

ROOT = Path(__file__).resolve().parents[1]
PARAMS = load_params(ROOT / "params.yaml")


def _groups() -> dict[str, list[type]]:
    """params.yaml group -> the dataclasses that read it (a group may be split between a result-changing and a
    run-time class)."""
    from pipeline.datasets.examples import ExamplesConfig
    from pipeline.datasets.sources import IngestConfig
    from pipeline.experiments.model import ModelConfig
    from pipeline.experiments.privacy import PrivacyConfig
    from pipeline.experiments.settings import RUN_TRAIN_KEYS, CacheConfig, RunSettings
    from pipeline.experiments.train_config import TrainConfig
    from pipeline.modeling.backbone import BackboneConfig
    from pipeline.modeling.target_tags import PostagConfig
    from pipeline.partitioning.schemes import PartitionConfig
    from pipeline.report import ReportConfig
    from pipeline.results.analysis import AnalyzeConfig
    from pipeline.results.evaluation import EvaluateConfig
    from pipeline.results.stats import BootstrapConfig

    assert set(RUN_TRAIN_KEYS) <= {f.name for f in dataclasses.fields(RunSettings)}
    return {
        "ingest": [IngestConfig],
        "examples": [ExamplesConfig],
        "partition": [PartitionConfig],
        "backbone": [BackboneConfig],
        "model": [ModelConfig, CacheConfig],
        "train": [TrainConfig, RunSettings],
        "privacy": [PrivacyConfig],
        "evaluate": [EvaluateConfig],
        "bootstrap": [BootstrapConfig],
        "postag": [PostagConfig],
        "analyze": [AnalyzeConfig],
        "report": [ReportConfig],
    }


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _disagreements(cls: type, group: dict, where: str) -> list[str]:
    found = []
    for f in dataclasses.fields(cls):
        default = _default(f)
        if (
            default is dataclasses.MISSING
            or (cls.__name__ == "RunSettings" and f.name == "cache")
            or (cls.__name__ == "TrainConfig" and f.name == "strategy_params")
        ):
            # required (params.yaml must carry it); RunSettings.cache is model's CacheConfig; strategy_params holds
            # the strategies' own keys, checked against their settings classes below
            continue
        key = f"{where}.{f.name}"
        if f.name not in group:
            found.append(f"{key}: default {default!r}, absent from params.yaml")
        elif dataclasses.is_dataclass(default):
            found += _disagreements(type(default), group[f.name] or {}, key)
        else:
            value = group[f.name]
            default = list(default) if isinstance(default, tuple) else default
            if default != value or type(default) is bool and type(value) is not bool:
                found.append(f"{key}: default {default!r} != params.yaml {value!r}")
    return found


@pytest.mark.parametrize("group", sorted(_groups()))
def test_every_default_is_params_yaml_value(group):
    found = []
    for cls in _groups()[group]:
        found += _disagreements(cls, PARAMS[group], group)
    assert found == []


def test_every_params_group_is_checked():
    mappings = {k for k, v in PARAMS.items() if isinstance(v, dict)} - {"experiments"}
    assert mappings == set(_groups())


def test_an_experiment_without_its_own_seed_trains_with_the_top_level_seed():
    from pipeline.experiments.entries import Experiment
    from pipeline.planning import declared

    seed = next(f for f in dataclasses.fields(Experiment) if f.name == "seed").default
    assert seed == PARAMS["seed"]
    entry = {"method": "fedavg", "partition": "domain/seed0"}
    params = {**PARAMS, "seed": 7, "experiments": {"a": entry, "b": {**entry, "seed": 2}}}
    assert [e.seed for e in declared(params)] == [7, 2]  # inherited; the entry's own wins
    assert {e.seed for e in declared(PARAMS)} == {PARAMS["seed"]}


def test_every_strategy_settings_default_is_params_yaml_value():
    from pipeline.experiments.methods import STRATEGIES

    found = []
    for spec in STRATEGIES.values():
        if spec.params_keys:
            group = PARAMS["train"] if spec.group is None else PARAMS["train"][spec.group]
            where = "train" if spec.group is None else f"train.{spec.group}"
            found += _disagreements(spec.settings_cls, group, where)
    assert found == []
