"""Experiments: the one reader of params `experiments:` and of plan files (docs/ARCHITECTURE.md, "Experiments, plans
and run-time settings"). A plan holds exactly what its experiment's result depends on, so a params change reruns only
the experiments it affects; run-time settings (:class:`RunSettings`) and paths stay out of plans.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipeline.common import atomic
from pipeline.common.config import ConfigError, Positive, config, from_dict, group, load_params
from pipeline.common.integrity import file_hash
from pipeline.federation.strategies.catalog import get_strategy
from pipeline.modeling.cache import DTYPES, CacheConfig
from pipeline.modeling.gates.catalog import GATES, MODE_GATES
from pipeline.modeling.losses import KDConfig
from pipeline.modeling.model import ModelConfig
from pipeline.partitioning.schemes import SCHEMES, PartitionConfig, scheme_client_names
from pipeline.paths import PATHS
from pipeline.privacy.settings import PrivacyConfig, client_level_problem, secure_aggregation_refusal
from pipeline.training.config import TrainConfig, train_config, train_keys
from pipeline.training.methods import MethodSpec, get_method


@config
class RunSettings:
    """params `train.engine`, `train.ray_*`, `train.round_timeout_s`/`admission_timeout_s` and the cache budgets of
    `model`: how a run executes, never what it computes; no DVC stage declares them (tests/test_experiments.py)."""

    engine: Literal["inprocess", "ray"] = "inprocess"
    ray_cpus_per_client: float = 1.0
    ray_gpus_per_client: float = 0.0
    round_timeout_s: Positive = 1800.0
    admission_timeout_s: Positive = 600.0
    cache: CacheConfig = field(default_factory=CacheConfig)


# The `train` and `model` keys of RunSettings. cache_dtype is not among them: a float16 prefix changes the logits.
RUN_TRAIN_KEYS = tuple(f.name for f in dataclasses.fields(RunSettings) if f.name != "cache")
RUN_MODEL_KEYS = tuple(f.name for f in dataclasses.fields(CacheConfig))


def run_settings(params: dict[str, Any], experiment: str | None = None) -> RunSettings:
    """The run-time settings of the params file, with ``experiment``'s own overrides of them (e.g. ``engine: ray``)."""
    train = dict(group(params, "train"))
    if experiment is not None:
        train.update((params.get("experiments") or {}).get(experiment) or {})
    model = group(params, "model")
    return from_dict(
        RunSettings,
        {
            **{k: train[k] for k in RUN_TRAIN_KEYS if k in train},
            "cache": from_dict(CacheConfig, {k: model[k] for k in RUN_MODEL_KEYS if k in model}, "params.yaml model"),
        },
        "params.yaml train",
    )


def load_run_settings(params_path: str | Path, experiment: str | None = None) -> RunSettings:
    """:func:`run_settings` of the params file a stage entry point names (the train stage: the project's; the
    federation commands: their ``--params``). A missing file is an error, never the defaults."""
    if not Path(params_path).exists():
        raise FileNotFoundError(
            f"{params_path}: params file not found (the run-time settings: engine, round "
            f"timeout, cache location and budgets)"
        )
    return run_settings(load_params(params_path), experiment)


RESERVED_NAMES = {"plans", "backbone"}  # directories under models/ that are not experiments
# Runs in progress (Plan.paths out_dir): git- and DVC-ignored, beside the prefix cache.
RUNS_DIR = PATHS.root / "data/cache/runs"
ENTRY_KEYS = ("method", "partition", "seed", "study", "tau")
PRIVACY_KEY = "privacy"  # an entry's overrides of params `privacy` (a privacy-utility study in one experiment)
MODEL_RESULT_KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig))


# Train keys that only matter for some methods: left out of other methods' plans so changing them does not
# rerun experiments whose result cannot change.
_KD_KEYS = ("kd_lambda", "kd_temperature", "kd_direction", "entropy_log_base")
_FEDERATED_KEYS = ("local_adapter", "fraction_train", "weight_by", "transfer_dtype", "transfer_delta")


def _relevant_train(train: TrainConfig, method: MethodSpec) -> dict[str, Any]:
    out = dataclasses.asdict(train)
    strategy_params = out.pop("strategy_params")
    drop: set[str] = {"kd_gate"} if train.kd_gate == "entropy" else set()  # the paper's gate: plans as before
    if method.kd_mode == "ce":
        drop.update(_KD_KEYS)
    if method.kd_mode != "selective":
        drop.update(("entropy_log_base", "tau_scale", "kd_gate"))
    if method.new_client is None:
        drop.add("new_client")
    if method.new_client != "post":
        drop.add("join")
    if not train.stop.enabled:
        drop.add("stop")  # a fixed number of rounds: plans as before train.stop existed
    if not method.federated:
        drop.update(_FEDERATED_KEYS)
    if method.local_from_global:
        drop.add("local_adapter")  # the server average overwrites the adapter whatever this says
    if train.transfer_dtype == "fp32":
        drop.add("transfer_delta")  # fp32 sends the weights themselves, exactly
    if train.max_train_examples_per_client is None:
        drop.add("weight_by")  # no cap: the trained count is the full train size
    if method.strategy is not None:  # the settings of this method's strategy only (its own params keys)
        out.update(get_strategy(method.strategy).plan_entries(strategy_params))
    return {k: v for k, v in out.items() if k not in drop}


@dataclass(frozen=True)
class Experiment:
    """One entry of params `experiments`, checked, with its tau resolved as its plan has it."""

    name: str
    method: str
    partition: str  # "<scheme>/seed<k>"
    seed: int = 0
    study: str = "main"
    tau: float | None = None  # the entry's tau, else the top-level tau for methods that read it, else None
    train: dict[str, Any] = field(default_factory=dict)  # the entry's overrides of params `train`
    tau_scale: str = "absolute"  # how the gate reads tau: the entry's train.tau_scale, else the params file's
    privacy: dict[str, Any] = field(default_factory=dict)  # the entry's overrides of params `privacy`
    dp: str = ""  # the privacy it trains with, in words (privacy_label; "" = none)

    @property
    def scheme(self) -> str:
        return self.partition.partition("/seed")[0]

    @property
    def variant(self) -> str:
        """The entry's train overrides as text, e.g. "fraction_train=0.67" ("" when none)."""
        return ",".join(f"{k}={self.train[k]}" for k in sorted(self.train))

    def privacy_config(self, params: dict[str, Any]) -> PrivacyConfig:
        """params `privacy` with this entry's overrides (`secagg` merged key by key)."""
        base = group(params, "privacy")
        merged = {**base, **self.privacy}
        if isinstance(base.get("secagg"), dict) and isinstance(self.privacy.get("secagg"), dict):
            merged["secagg"] = {**base["secagg"], **self.privacy["secagg"]}
        return from_dict(
            PrivacyConfig, merged, f"experiments.{self.name} privacy" if self.privacy else "params.yaml privacy"
        )


def parse_entry(name: str, raw: dict[str, Any], params: dict[str, Any]) -> Experiment:
    """An experiments entry: known keys plus flat `train` overrides (e.g. ``fraction_train: 0.67``)."""
    where = f"params.yaml experiments.{name}"
    if not name or "/" in name or name in RESERVED_NAMES:
        raise ConfigError(
            f"params.yaml experiments: invalid experiment name {name!r} (no '/', not one of "
            f"{sorted(RESERVED_NAMES)}: those are directories under models/)"
        )
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    train_fields = train_keys() | set(RUN_TRAIN_KEYS)
    overrides = {k: v for k, v in raw.items() if k not in ENTRY_KEYS and k != PRIVACY_KEY}
    if unknown := sorted(set(overrides) - train_fields):
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}; allowed: {list(ENTRY_KEYS)}, {PRIVACY_KEY} (a "
            f"mapping of params.yaml privacy keys) and the train keys {sorted(train_fields)}"
        )
    privacy = raw.get(PRIVACY_KEY) or {}
    if not isinstance(privacy, dict):
        raise ConfigError(
            f"{where}.{PRIVACY_KEY}: expected a mapping of privacy keys "
            f"({sorted(f.name for f in dataclasses.fields(PrivacyConfig))}), got {privacy!r}"
        )
    if missing := [k for k in ("method", "partition") if k not in raw]:
        raise ConfigError(f"{where}: missing required key {missing[0]!r}")
    scheme, sep, seed = str(raw["partition"]).partition("/seed")
    if not sep or not seed.isdigit():
        raise ConfigError(f"{where}: partition must look like '<scheme>/seed<k>', got {raw['partition']!r}")
    if scheme not in SCHEMES:
        raise ConfigError(f"{where}.partition: unknown partition scheme {scheme!r}; allowed: {sorted(SCHEMES)}")
    try:
        method = get_method(str(raw["method"]))
    except ConfigError as exc:
        raise ConfigError(f"{where}.method: {exc}") from None
    tau = raw.get("tau")
    if method.uses_tau:
        if tau is None and params.get("tau") is None:
            raise ConfigError(f"{where}: method {method.name!r} needs tau (the entry's, or the top-level tau)")
        tau = float(tau if tau is not None else params["tau"])
        if not tau > 0:  # the gate is H(q_g) < tau with H >= 0: tau <= 0 would never distil
            raise ConfigError(f"{where}: tau={tau} must be > 0 (entropy threshold)")
    elif tau is not None:
        raise ConfigError(f"{where}: tau is set but method {method.name!r} does not use it")
    tau_scale = str(overrides.get("tau_scale", (params.get("train") or {}).get("tau_scale", "absolute")))
    exp = Experiment(
        name=str(name),
        method=method.name,
        partition=str(raw["partition"]),
        seed=int(raw.get("seed", params.get("seed", 0))),
        study=str(raw.get("study", "main")),
        tau=tau,
        train=overrides,
        tau_scale=tau_scale,
        privacy=dict(privacy),
    )
    resolved = exp.privacy_config(params)  # checks the entry's privacy keys and values
    if privacy and (resolved.enabled or resolved.secure_aggregation) and not method.federated:
        raise ConfigError(
            f"{where}.{PRIVACY_KEY}: method {method.name!r} sends nothing (privacy applies to federated methods)"
        )
    return dataclasses.replace(exp, dp=privacy_label(resolved) if method.federated else "")


def privacy_label(privacy: PrivacyConfig) -> str:
    """The privacy a run trains with, in words for tables and figures: "" (none), "DP-SGD ε≤3 δ≤1e-5" (a target,
    with the delta it holds at: mode example's default is at most 1e-5, an explicit one is given as is) or
    "DP-SGD σ=1.1" (a noise multiplier); other modes by their name; "+ SecAgg+" (or "SecAgg+" alone) under
    secure aggregation."""
    parts = []
    if privacy.enabled:
        name = {"example": "DP-SGD", "client": "client-level DP"}.get(privacy.mode, f"DP {privacy.mode}")
        if privacy.target_epsilon is not None:
            delta = (
                f"δ={privacy.delta:g}"
                if privacy.delta is not None
                else ("δ≤1e-05" if privacy.mode == "example" else "δ=1e-05")
            )  # the defaults (pipeline.privacy.accounting)
            parts.append(f"{name} ε≤{privacy.target_epsilon:g} {delta.replace('e-0', 'e-')}")
        else:
            parts.append(f"{name} σ={privacy.noise_multiplier:g}")
    if privacy.secure_aggregation:
        parts.append("SecAgg+")
    return " + ".join(parts)


def with_labels(experiments: list[Experiment]) -> dict[str, str]:
    """A display label per experiment: the method, plus whatever else varies within its study (tau, overrides,
    partition scheme), so one study's configurations are told apart without hard-coding study layouts."""
    by_study: dict[str, list[Experiment]] = {}
    for e in experiments:
        by_study.setdefault(e.study, []).append(e)
    labels = {}
    for members in by_study.values():
        varying = [attr for attr in ("scheme", "tau", "variant", "dp") if len({getattr(e, attr) for e in members}) > 1]
        for e in members:
            parts = [e.method]
            for attr in varying:
                value = getattr(e, attr)
                if value not in (None, ""):
                    parts.append(value if attr == "variant" else f"{attr}={value:g}" if attr == "tau" else value)
            labels[e.name] = " ".join(str(x) for x in parts)
    return labels


def declared(params: dict[str, Any]) -> list[Experiment]:
    """Every experiment of the params file, in its order, each checked (the first bad entry raises, naming it)."""
    return [parse_entry(name, raw, params) for name, raw in group(params, "experiments").items()]


def extension_md5(method: MethodSpec, kd_gate: str) -> dict[str, str]:
    """md5 of the source of the strategy module and the KD gate module ``method`` runs, by module name."""
    used = []
    if method.strategy is not None:
        used.append(get_strategy(method.strategy).build)
    if method.kd_mode != "ce":
        used.append(GATES[MODE_GATES.get(method.kd_mode, kd_gate)])
    return {f.__module__: file_hash(Path(sys.modules[f.__module__].__file__), "md5") for f in used}


def resolve_plan(exp: Experiment, params: dict[str, Any]) -> dict[str, Any]:
    """The resolved configuration of one experiment (what its train stage reads)."""
    method, where = get_method(exp.method), f"params.yaml experiments.{exp.name}"
    merged = {**group(params, "train"), **exp.train}  # run-time keys left out (run_settings)
    train = train_config({k: v for k, v in merged.items() if k not in RUN_TRAIN_KEYS}, f"experiments.{exp.name} train")
    if train.stop.enabled:  # the run's round budget is the rule's ceiling (train.rounds is the fixed count)
        train = dataclasses.replace(train, rounds=train.stop.max_rounds)
    model = params.get("model") or {}
    plan: dict[str, Any] = {
        "experiment": exp.name,
        "study": exp.study,
        "method": method.name,
        "partition": exp.partition,
        "seed": exp.seed,
        "train": _relevant_train(train, method),
        "model": {k: v for k, v in model.items() if k in MODEL_RESULT_KEYS},
    }
    if method.federated and exp.scheme in SCHEMES:
        # The clients the server admits (a deployed server reads no partition file): the scheme's, from params
        plan["clients"] = scheme_client_names(
            exp.scheme, from_dict(PartitionConfig, params.get("partition"), "partition")
        )
    if train.prefix_cache and model.get("cache_dtype", "float32") != "float32":
        plan["cache_dtype"] = model["cache_dtype"]  # a float16/bfloat16 prefix changes the logits; float32 is exact
    if method.new_client == "post" and train.join.max_round > train.rounds:
        raise ValueError(
            f"{where}: train.join.max_round {train.join.max_round} > rounds {train.rounds}: the new "
            f"client might never join"
        )
    if method.uses_tau:
        plan["tau"] = exp.tau
        # the loss's own check of tau against train.tau_scale, at plan time rather than in training
        from_dict(KDConfig, {"tau": exp.tau, "tau_scale": train.tau_scale, "kd_gate": train.kd_gate}, where)
    privacy = exp.privacy_config(params)
    if privacy.mode == "client" and (problem := client_level_problem(method, train.transfer_dtype, privacy)):
        raise ConfigError(f"{where}: privacy.mode client: {problem}")
    if privacy.secure_aggregation and (refusal := secure_aggregation_refusal(method, train.transfer_dtype, privacy)):
        raise ConfigError(f"{where}: privacy.secure_aggregation: {refusal}")
    if (privacy.enabled or privacy.secure_aggregation) and method.federated:
        if privacy.mode == "example" and method.kd_mode == "selective" and train.tau_scale == "batch_quantile":
            # the gate of every token would depend on the other examples of its batch: no per-example bound
            raise ConfigError(
                f"{where}: privacy.mode {privacy.mode} needs a per-example loss, but train.tau_scale "
                f"batch_quantile gates each token by a quantile over the whole batch; use absolute or "
                f"max_entropy"
            )
        plan["privacy"] = privacy.plan_dict()
    if method.uses_postags and PATHS.postags.exists():
        # The POS tags enter the result only here; their hash makes this plan (alone) change when they do.
        plan["postags_md5"] = file_hash(PATHS.postags, "md5")
    if extensions := extension_md5(method, train.kd_gate):
        plan["extension_md5"] = extensions
    return plan


@dataclass
class Plan:
    """A plan file as the train stage reads it: one experiment, resolved."""

    experiment: str
    study: str
    method: str
    partition: str
    seed: int
    train: TrainConfig
    model: dict[str, Any]
    tau: float | None = None
    postags_md5: str | None = None
    extension_md5: dict[str, str] | None = None  # source hashes of the strategy and gate modules it runs
    cache_dtype: str | None = None  # of the prefix cache, when not the exact float32 (absent = float32)
    privacy: PrivacyConfig | None = None  # example: DP-SGD of the local training; client: client-level DP
    clients: list[str] | None = None  # federated: the clients the server admits, in the partition's order
    source: str = ""  # the plan file it was read from

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
            "out_dir": str(RUNS_DIR / f"{self.experiment}-{plan_hash(self)[:16]}"),
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


def plan_hash(plan: Plan) -> str:
    """Identifies a configuration: a checkpoint is resumed only by the plan that wrote it."""
    return record_hash(plan.to_json_dict())


def record_hash(record: dict[str, Any]) -> str:
    """:func:`plan_hash` of a plan read back from ``models/<exp>/experiment.json`` (``Plan.to_json_dict``)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()


def read_plan(path: str | Path) -> Plan:
    """A plan file (``models/plans/<exp>.json``, or the copy ``models/<exp>/experiment.json`` a run keeps)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: plan file not found (run `python -m pipeline.plan` first)")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p}: not a plan file (invalid JSON: {exc})") from None
    train = train_config(raw.pop("train", {}), f"{p}: train")
    privacy = from_dict(PrivacyConfig, raw.pop("privacy"), f"{p}: privacy") if raw.get("privacy") else None
    try:
        plan = Plan(train=train, privacy=privacy, source=str(p), **raw)
        plan.spec  # noqa: B018 - an unknown method
    except (TypeError, ConfigError) as exc:
        raise ConfigError(f"{p}: not a plan file ({exc})") from None
    from_dict(ModelConfig, plan.model, f"{p}: model")  # before the stage touches its outputs or MLflow
    return plan


def check_params(params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every experiment's plan, each group it reads checked (the first problem raises ConfigError naming it)."""
    # Checked here, before any plan is written, although only the train stage builds the model from it.
    check_model_group(params)
    run_settings(params)
    return {exp.name: resolve_plan(exp, params) for exp in declared(params)}


def write_plans(params: dict[str, Any], out_dir: Path) -> list[Path]:
    plans = check_params(params)
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
    # A plan whose experiment left the params file is stale: remove it so nothing trains from it.
    for stale in sorted(set(out_dir.glob("*.json")) - set(written)):
        stale.unlink()
    return written


def check_model_group(params: dict[str, Any]) -> ModelConfig:
    """params `model`, its result-changing keys (the cache's are :class:`CacheConfig`'s)."""
    model = group(params, "model")
    known = set(MODEL_RESULT_KEYS) | set(RUN_MODEL_KEYS) | {"cache_dtype"}
    unknown = sorted(set(model) - known)
    if unknown:
        raise ConfigError(f"model: unknown key(s) {unknown}; allowed: {sorted(known)}")
    if model.get("cache_dtype", "float32") not in DTYPES:
        raise ConfigError(f"params.yaml model.cache_dtype={model['cache_dtype']!r}; expected one of {sorted(DTYPES)}")
    return ModelConfig.from_group(model)
