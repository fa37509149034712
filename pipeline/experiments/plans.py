"""Plan files as the stages read them (``models/plans/<exp>.json``; pipeline.planning writes them). A plan holds exactly
what its experiment's result depends on, so a params change reruns only the experiments it affects; run-time settings
and paths stay out of plans (docs/ARCHITECTURE.md, "Experiments, plans and run-time settings")."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from pipeline.common.config import ConfigError, NonNegativeInt, config, from_dict
from pipeline.common.schema import read_json
from pipeline.experiments.methods import MethodSpec, get_method
from pipeline.experiments.model import ModelConfig
from pipeline.experiments.privacy import PrivacyConfig
from pipeline.experiments.train_config import TrainConfig, train_config
from pipeline.paths import PATHS

# Runs in progress (Plan.paths out_dir): git- and DVC-ignored, beside the prefix cache.
RUNS_DIR = PATHS.root / "data/cache/runs"


@config
class Plan:
    """A plan file as the train stage reads it: one experiment, resolved (its values checked as planning does)."""

    experiment: str
    study: str
    method: str
    partition: str
    seed: NonNegativeInt
    train: TrainConfig
    model: dict[str, Any]
    tau: Annotated[float, Field(gt=0.0, allow_inf_nan=True)] | None = None  # as an entry's (entries.Tau)
    postags_md5: str | None = None
    extension_md5: dict[str, str] | None = None  # source hashes of the strategy and gate modules it runs
    cache_dtype: str | None = None  # of the prefix cache, when not the exact float32 (absent = float32)
    privacy: PrivacyConfig | None = None  # example: DP-SGD of the local training; client: client-level DP
    clients: list[str] | None = None  # federated: the clients the server admits, in the partition's order
    source: str = ""  # the plan file it was read from

    # What is derived from the fields is made once (a plan is read, never changed): its model configuration (every
    # micro-batch's shapes read it) and its hash (every path of a run names it).
    @cached_property
    def model_config(self) -> ModelConfig:
        """The checked model settings."""
        return from_dict(ModelConfig, self.model, f"{self.source}: model")

    @cached_property
    def hash(self) -> str:
        """Identifies a configuration: a checkpoint is resumed only by the plan that wrote it."""
        return record_hash(self.to_json_dict())

    @property
    def spec(self) -> MethodSpec:
        return get_method(self.method)

    @property
    def paths(self) -> dict[str, str]:
        """Where this experiment reads and writes; ``out_dir``: a run's own directory while it runs (one per
        configuration: the plan hash's first 16 hex digits), published to ``model_dir`` when it finishes
        (pipeline.training.checkpoints.publish_outputs)."""
        paths = {
            "examples": str(PATHS.examples),
            "partition": str(PATHS.partition(self.partition)),
            "backbone": str(PATHS.backbone),
            "out_dir": str(RUNS_DIR / f"{self.experiment}-{self.hash[:16]}"),
            "model_dir": str(PATHS.model_dir(self.experiment)),
            "reports_dir": str(PATHS.train_report(self.experiment)),
        }
        if self.spec.uses_postags:
            paths["postags"] = str(PATHS.postags)
        return paths

    def to_json_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        d["train"] |= d["train"].pop("strategy_params")  # the strategy's keys where the plan file has them
        for optional in ("privacy", "cache_dtype", "clients", "extension_md5"):
            if d[optional] is None:
                d.pop(optional)  # plans without them keep their hash (and their checkpoints)
        if self.privacy is not None:
            d["privacy"] = self.privacy.plan_dict()  # its mode's keys only, as resolve_plan wrote them
        return d


def record_hash(record: dict[str, Any]) -> str:
    """:attr:`Plan.hash` of a plan read back from ``models/<exp>/experiment.json`` (``Plan.to_json_dict``)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()


def read_plan(path: str | Path) -> Plan:
    """A plan file (``models/plans/<exp>.json``, or the copy ``models/<exp>/experiment.json`` a run keeps)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: plan file not found (run `python -m pipeline.plan` first)")
    raw = read_json(p, "plan file")
    train = raw.pop("train", None)  # null or absent: refused as Plan's, not read as the code's defaults
    train = train_config(train, f"{p}: train") if isinstance(train, dict) else train
    privacy = raw.pop("privacy", None)  # null or {}: no privacy, as a plan without the key
    privacy = from_dict(PrivacyConfig, privacy, f"{p}: privacy") if privacy else None
    try:
        plan = Plan(train=train, privacy=privacy, source=str(p), **raw)
        if plan.spec.uses_tau != (plan.tau is not None):  # selective KD without one would read tau as inf
            raise ConfigError(f"tau {plan.tau} with method {plan.method!r}: selective KD needs one, no other has one")
    except (TypeError, ConfigError) as exc:
        raise ConfigError(f"{p}: not a plan file ({exc})") from None
    plan.model_config  # noqa: B018 - checked before the stage touches its outputs or MLflow
    return plan
