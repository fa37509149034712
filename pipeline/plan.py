"""Stage `plan`: one resolved configuration per experiment, `models/plans/<experiment>.json`.

Each experiment of params.yaml `experiments` (``{method, partition: "<scheme>/seed<k>", seed, study, ...}``,
optionally with `tau` or any `train` key as an override) becomes a JSON file holding exactly what its result
depends on. The train stages depend on their plan file, not on params, so a change reruns only the experiments
it affects: tau is written only for methods that read it (selective KD) - `dvc exp run -S tau=4` reruns the
selective-KD experiments and nothing else; KD, proximal and server-optimiser settings likewise appear only in
plans of methods that use them, transfer and FedAvg-weighting settings only in federated plans (transfer_delta
only with a lossy transfer_dtype, weight_by only under a train-size cap). The POS-tag file's hash enters only the `hardkd` plans.
The `privacy` group enters federated plans only, and only when its mode is not `none` (DP-SGD protects what a
client sends; `single` and `centralized` send nothing), so `dvc exp run -S privacy.mode=example ...` reruns the
federated experiments.

    python -m pipeline.plan [--params params.yaml] [--out models/plans]
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.common import atomic
from pipeline.federation.compression import TRANSFER_DTYPES
from pipeline.common.config import ConfigError, from_dict, load_params, to_dict
from pipeline.modeling.losses import TAU_SCALES
from pipeline.training.methods import MethodSpec, get_method
from pipeline.modeling.model import ModelConfig
from pipeline.partitioning.schemes import SCHEMES
from pipeline.training.privacy import PrivacyConfig
from pipeline.federation.strategies import FedOptConfig

PLANS_DIR = Path("models/plans")
EXAMPLES = "data/processed/examples.parquet"
BACKBONE = "models/backbone"
POSTAGS = "data/processed/postags.parquet"
RESERVED_NAMES = {"plans", "backbone"}


@dataclass
class JoinConfig:
    """When the new client of the post-addition study joins (params.yaml `train.join`): once the existing clients
    have converged, i.e. their mean validation loss improved by less than ``min_rel_improvement`` (relative to the
    best earlier round) in each of the last ``patience`` rounds, and at ``max_round`` at the latest."""

    min_rel_improvement: float = 0.01
    patience: int = 1
    max_round: int = 3

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_rel_improvement < 1.0:
            raise ValueError("params.yaml train.join: min_rel_improvement must be in [0, 1)")
        if self.patience < 1:
            raise ValueError("params.yaml train.join: patience must be >= 1")
        if self.max_round < 2:
            raise ValueError("params.yaml train.join: max_round must be >= 2 (round 1 has no earlier round)")


@dataclass
class TrainConfig:
    """params.yaml `train` (the comments on each default live in params.yaml)."""

    rounds: int = 3
    local_epochs: int = 1
    batch_size: int = 4
    grad_accum_steps: int = 1
    bucket_by_length: bool = True
    lr: float = 2.0e-4
    weight_decay: float = 0.01
    # AdamW decay on LayerNorm weights and biases too (usual practice, and the default, leaves them undecayed).
    decay_norm_and_bias: bool = False
    kd_lambda: float = 0.2
    kd_temperature: float = 1.0
    kd_direction: str = "teacher_to_student"
    entropy_log_base: str = "e"
    tau_scale: str = "absolute"  # how selective KD reads tau (pipeline.modeling.losses.TAU_SCALES)
    loss_normalisation: str = "tokens"
    local_adapter: str = "keep"
    fraction_train: float = 1.0
    proximal_mu: float = 0.01
    fedopt: FedOptConfig = field(default_factory=FedOptConfig)
    new_client: str = "SAMSum"
    join: JoinConfig = field(default_factory=JoinConfig)
    max_train_examples_per_client: int | None = None
    max_valid_examples_per_client: int | None = None
    # FedAvg weight of a client: "full" = its whole train split |D_i| (the paper's data-size weights), "trained" =
    # the examples it trained on this round (differs only under max_train_examples_per_client).
    weight_by: str = "full"
    transfer_dtype: str = "fp32"  # adapter encoding on the wire (pipeline.federation.compression): fp32 | fp16 | int8
    # Lossy encodings as differences: uplink to the global received this round, downlink to the round-0 adapter
    # (ignored for fp32, which is exact).
    transfer_delta: bool = False
    prefix_cache: bool = True
    engine: str = "inprocess"
    ray_cpus_per_client: float = 1.0
    ray_gpus_per_client: float = 0.0
    round_timeout_s: float = 86400.0

    def __post_init__(self) -> None:
        if isinstance(self.fedopt, dict):
            self.fedopt = from_dict(FedOptConfig, self.fedopt, "train.fedopt")
        if isinstance(self.join, dict):
            self.join = from_dict(JoinConfig, self.join, "train.join")
        checks = [
            (self.rounds >= 1, "rounds must be >= 1"),
            (self.local_epochs >= 1, "local_epochs must be >= 1"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.grad_accum_steps >= 1, "grad_accum_steps must be >= 1"),
            (0.0 < self.fraction_train <= 1.0, "fraction_train must be in (0, 1]"),
            (0.0 <= self.kd_lambda <= 1.0, "kd_lambda must be in [0, 1]"),
            (self.local_adapter in ("keep", "reset"), "local_adapter must be 'keep' or 'reset'"),
            (self.engine in ("inprocess", "ray"), "engine must be 'inprocess' or 'ray'"),
            (self.weight_by in ("full", "trained"), "weight_by must be 'full' or 'trained'"),
            (self.transfer_dtype in TRANSFER_DTYPES, f"transfer_dtype must be one of {TRANSFER_DTYPES}"),
            (isinstance(self.transfer_delta, bool), "transfer_delta must be true or false"),
            (self.tau_scale in TAU_SCALES, f"tau_scale must be one of {TAU_SCALES}"),
        ]
        for ok, problem in checks:
            if not ok:
                raise ConfigError(f"params.yaml train: {problem}")


# Train keys that only matter for some methods: left out of other methods' plans so changing them does not
# rerun experiments whose result cannot change.
_KD_KEYS = ("kd_lambda", "kd_temperature", "kd_direction", "entropy_log_base")
_FEDERATED_KEYS = ("local_adapter", "fraction_train", "engine", "ray_cpus_per_client", "ray_gpus_per_client",
                   "round_timeout_s", "weight_by", "transfer_dtype", "transfer_delta")


def _relevant_train(train: TrainConfig, method: MethodSpec) -> dict[str, Any]:
    out = to_dict(train)
    drop: set[str] = set()
    if method.kd_mode == "ce":
        drop.update(_KD_KEYS)
    if method.kd_mode != "selective":
        drop.update(("entropy_log_base", "tau_scale"))
    if not method.proximal:
        drop.add("proximal_mu")
    if method.strategy != "fedopt":
        drop.add("fedopt")
    if method.new_client is None:
        drop.add("new_client")
    if method.new_client != "post":
        drop.add("join")
    if not method.federated:
        drop.update(_FEDERATED_KEYS)
    if method.local_from_global:
        drop.add("local_adapter")  # the server average overwrites the adapter whatever this says
    if train.transfer_dtype == "fp32":
        drop.add("transfer_delta")  # fp32 sends the weights themselves, exactly
    if train.max_train_examples_per_client is None:
        drop.add("weight_by")  # no cap: the trained count is the full train size
    return {k: v for k, v in out.items() if k not in drop}


@dataclass
class ExperimentEntry:
    method: str
    partition: str  # "<scheme>/seed<k>"
    seed: int = 0
    study: str = "main"
    tau: float | None = None
    train: dict[str, Any] = field(default_factory=dict)  # overrides of params.yaml `train`


def parse_entry(name: str, raw: dict[str, Any], train_fields: set[str]) -> ExperimentEntry:
    """An experiments entry: known keys plus flat `train` overrides (e.g. ``fraction_train: 0.67``)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"params.yaml experiments.{name}: expected a mapping, got {type(raw).__name__}")
    base = {k: raw[k] for k in ("method", "partition", "seed", "study", "tau") if k in raw}
    overrides = {k: v for k, v in raw.items() if k not in base}
    unknown = sorted(set(overrides) - train_fields)
    if unknown:
        raise ValueError(
            f"params.yaml experiments.{name}: unknown key(s) {unknown}; allowed: method, partition, seed, study, "
            f"tau and the train keys {sorted(train_fields)}"
        )
    for key in ("method", "partition"):
        if key not in base:
            raise ConfigError(f"params.yaml experiments.{name}: missing required key {key!r}")
    scheme, sep, seed = str(base["partition"]).partition("/seed")
    if not sep or not seed.isdigit():
        raise ConfigError(f"params.yaml experiments.{name}: partition must look like '<scheme>/seed<k>', "
                         f"got {base['partition']!r}")
    if scheme not in SCHEMES:
        raise ConfigError(f"params.yaml experiments.{name}.partition: unknown partition scheme {scheme!r}; "
                          f"allowed: {sorted(SCHEMES)}")
    return ExperimentEntry(**base, train=overrides)


def _file_md5(path: Path) -> str:
    h = hashlib.md5()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve_plan(name: str, entry: ExperimentEntry, params: dict[str, Any]) -> dict[str, Any]:
    """The resolved configuration of one experiment (what its train stage reads)."""
    try:
        method = get_method(entry.method)
    except ConfigError as exc:
        raise ConfigError(f"params.yaml experiments.{name}.method: {exc}") from None
    train = from_dict(TrainConfig, {**(params.get("train") or {}), **entry.train}, f"experiments.{name} train")
    plan: dict[str, Any] = {
        "experiment": name,
        "study": entry.study,
        "method": method.name,
        "partition": entry.partition,
        "seed": int(entry.seed),
        "train": _relevant_train(train, method),
        "model": params.get("model") or {},
        "paths": {
            "examples": EXAMPLES,
            "partition": f"data/partitions/{entry.partition}.json",
            "backbone": BACKBONE,
            "out_dir": f"models/{name}",
            "reports_dir": f"reports/train/{name}",
        },
    }
    if method.new_client == "post" and train.join.max_round > train.rounds:
        raise ValueError(f"params.yaml experiments.{name}: train.join.max_round {train.join.max_round} > rounds "
                         f"{train.rounds}: the new client might never join")
    if method.uses_tau:
        plan["tau"] = float(entry.tau if entry.tau is not None else params["tau"])
        if not plan["tau"] > 0:  # the gate is H(q_g) < tau with H >= 0: tau <= 0 would never distil
            raise ConfigError(f"params.yaml experiments.{name}: tau={plan['tau']} must be > 0 (entropy threshold)")
        if train.tau_scale != "absolute" and plan["tau"] > 1:
            raise ConfigError(f"params.yaml experiments.{name}: tau={plan['tau']} must be in (0, 1] with "
                              f"train.tau_scale={train.tau_scale} (a fraction of ln|V| or a quantile)")
    elif entry.tau is not None:
        raise ConfigError(f"params.yaml experiments.{name}: tau is set but method {method.name!r} does not use it")
    privacy = from_dict(PrivacyConfig, params.get("privacy"), "params.yaml privacy")
    if privacy.enabled and method.federated:
        if method.kd_mode == "selective" and train.tau_scale == "batch_quantile":
            # the gate of every token would depend on the other examples of its batch: no per-example bound
            raise ConfigError(f"params.yaml experiments.{name}: privacy.mode {privacy.mode} needs a per-example "
                              f"loss, but train.tau_scale batch_quantile gates each token by a quantile over the "
                              f"whole batch; use absolute or max_entropy")
        plan["privacy"] = to_dict(privacy)
    if method.uses_postags:
        plan["paths"]["postags"] = POSTAGS
        # The POS tags enter the result only here; their hash makes this plan (alone) change when they do.
        if Path(POSTAGS).exists():
            plan["postags_md5"] = _file_md5(Path(POSTAGS))
    return plan


@dataclass
class Plan:
    """A plan file as the train stage reads it."""

    experiment: str
    study: str
    method: str
    partition: str
    seed: int
    train: TrainConfig
    model: dict[str, Any]
    paths: dict[str, str]
    tau: float | None = None
    postags_md5: str | None = None
    privacy: PrivacyConfig | None = None  # DP-SGD of the client's training (absent = none)
    source: str = ""  # the plan file it was read from

    @property
    def spec(self) -> MethodSpec:
        return get_method(self.method)

    def to_json_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        if d["privacy"] is None:
            d.pop("privacy")  # plans without privacy keep their hash (and their checkpoints)
        return d


def plan_hash(plan: Plan) -> str:
    """Identifies a configuration: a checkpoint is resumed only by the plan that wrote it."""
    return record_hash(plan.to_json_dict())


def record_hash(record: dict[str, Any]) -> str:
    """:func:`plan_hash` of a plan read back from ``models/<exp>/experiment.json`` (``Plan.to_json_dict``)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()


def read_plan(path: str | Path) -> Plan:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: plan file not found (run `python -m pipeline.plan` first)")
    raw = json.loads(p.read_text())
    train = from_dict(TrainConfig, raw.pop("train", {}), f"{p}: train")
    privacy = from_dict(PrivacyConfig, raw.pop("privacy"), f"{p}: privacy") if raw.get("privacy") else None
    try:
        plan = Plan(train=train, privacy=privacy, source=str(p), **raw)
    except TypeError as exc:
        raise ConfigError(f"{p}: not a plan file ({exc})") from None
    try:
        get_method(plan.method)
    except ConfigError as exc:
        raise ConfigError(f"{p}: method: {exc}") from None
    from_dict(ModelConfig, plan.model, f"{p}: model")  # before the stage touches its outputs or MLflow
    return plan


def write_plans(params: dict[str, Any], out_dir: Path) -> list[Path]:
    experiments = params.get("experiments") or {}
    if not isinstance(experiments, dict):
        raise ConfigError("params.yaml experiments: expected a mapping of experiment name -> entry")
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    # Checked here, before any plan is written, although only the train stage builds the model from it.
    from_dict(ModelConfig, params.get("model"), "model")
    plans = {}
    for name, raw in experiments.items():
        if not name or "/" in name or name in RESERVED_NAMES:
            raise ConfigError(f"params.yaml experiments: invalid experiment name {name!r} (no '/', not one of "
                             f"{sorted(RESERVED_NAMES)}: those are directories under models/)")
        plans[name] = resolve_plan(name, parse_entry(name, raw, train_fields), params)
    # Every experiment is checked before the first plan is written: a bad entry leaves the old plans as they were.
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plan in plans.items():
        path = out_dir / f"{name}.json"
        text = json.dumps(plan, indent=2, sort_keys=True) + "\n"
        # Rewrite only on change: the file is what downstream stages hash.
        if not path.exists() or path.read_text() != text:
            atomic.write_text(path, text)
        written.append(path)
    # A plan whose experiment left params.yaml is stale: remove it so nothing trains from it.
    for stale in sorted(set(out_dir.glob("*.json")) - set(written)):
        stale.unlink()
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", default=str(PLANS_DIR))
    args = ap.parse_args(argv)
    written = write_plans(load_params(args.params), Path(args.out))
    print(f"plan: wrote {len(written)} plan(s) to {args.out}")


if __name__ == "__main__":
    from pipeline.common.cli import run as run_cli

    raise SystemExit(run_cli(main))
