"""Where every stage reads and writes: the path table of docs/ARCHITECTURE.md as code, under one root.

Paths are relative to the project root, as DVC runs every stage from it (dvc.yaml repeats them as deps and outs;
tests/test_dvc_layout.py checks the two agree). Tests point a :class:`ProjectPaths` at a temporary directory.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def _at(relative: str) -> property:
    return property(lambda self: self.root / relative)


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
    train_reports = _at("reports/train")
    eval_reports = _at("reports/eval")
    analysis = _at("reports/analysis")
    kd_analysis = _at("reports/analysis/kd_analysis.json")
    timing = _at("reports/timing")
    tables = _at("reports/tables")
    figures = _at("reports/figures")
    plots = _at("reports/plots")
    human_eval = _at("reports/human_eval")

    def partition(self, partition: str) -> Path:
        """``partition`` as experiments name it, ``<scheme>/seed<k>``."""
        return self.partitions / f"{partition}.json"

    def model_dir(self, experiment: str) -> Path:
        """An experiment's adapters, rounds, gate log, the plan it trained (experiment.json) and checkpoints."""
        return self.models / experiment

    def gate_log(self, experiment: str) -> Path:
        return self.model_dir(experiment) / "gate_log.parquet"

    def train_report(self, experiment: str) -> Path:
        return self.train_reports / experiment

    def train_metrics(self, experiment: str) -> Path:
        return self.train_report(experiment) / "metrics.json"

    def eval_dir(self, experiment: str) -> Path:
        return self.eval_reports / experiment

    def eval_metrics(self, experiment: str) -> Path:
        return self.eval_dir(experiment) / "metrics.json"


PATHS = ProjectPaths()
