"""Where every stage reads and writes: the path table of docs/ARCHITECTURE.md as code, under one root.

Paths are relative to the project root, as DVC runs every stage from it (dvc.yaml repeats them as deps and outs;
tests/test_dvc_layout.py checks the two agree). Tests point a :class:`ProjectPaths` at a temporary directory.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProjectPaths:
    root: Path = Path(".")

    # --- data -------------------------------------------------------------------------------------------------
    @property
    def interim_dir(self) -> Path:
        return self.root / "data/interim"

    @property
    def examples(self) -> Path:
        return self.root / "data/processed/examples.parquet"

    @property
    def data_reports(self) -> Path:
        return self.root / "reports/data"

    @property
    def partitions(self) -> Path:
        return self.root / "data/partitions"

    def partition(self, partition: str) -> Path:
        """``partition`` as experiments name it, ``<scheme>/seed<k>``."""
        return self.partitions / f"{partition}.json"

    @property
    def partition_reports(self) -> Path:
        return self.root / "reports/partitions"

    @property
    def postags(self) -> Path:
        return self.root / "data/processed/postags.parquet"

    # --- models -----------------------------------------------------------------------------------------------
    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def backbone(self) -> Path:
        return self.models / "backbone"

    @property
    def backbone_report(self) -> Path:
        return self.reports / "backbone.json"

    @property
    def plans(self) -> Path:
        return self.models / "plans"

    def plan(self, experiment: str) -> Path:
        return self.plans / f"{experiment}.json"

    def model_dir(self, experiment: str) -> Path:
        """An experiment's adapters, rounds, gate log, the plan it trained (experiment.json) and checkpoints."""
        return self.models / experiment

    def gate_log(self, experiment: str) -> Path:
        return self.model_dir(experiment) / "gate_log.parquet"

    # --- reports ----------------------------------------------------------------------------------------------
    @property
    def reports(self) -> Path:
        return self.root / "reports"

    @property
    def train_reports(self) -> Path:
        return self.reports / "train"

    def train_report(self, experiment: str) -> Path:
        return self.train_reports / experiment

    def train_metrics(self, experiment: str) -> Path:
        return self.train_report(experiment) / "metrics.json"

    @property
    def eval_reports(self) -> Path:
        return self.reports / "eval"

    def eval_dir(self, experiment: str) -> Path:
        return self.eval_reports / experiment

    def eval_metrics(self, experiment: str) -> Path:
        return self.eval_dir(experiment) / "metrics.json"

    @property
    def analysis(self) -> Path:
        return self.reports / "analysis"

    @property
    def kd_analysis(self) -> Path:
        return self.analysis / "kd_analysis.json"

    @property
    def timing(self) -> Path:
        return self.reports / "timing"

    @property
    def tables(self) -> Path:
        return self.reports / "tables"

    @property
    def figures(self) -> Path:
        return self.reports / "figures"

    @property
    def plots(self) -> Path:
        return self.reports / "plots"

    @property
    def human_eval(self) -> Path:
        return self.reports / "human_eval"



PATHS = ProjectPaths()
