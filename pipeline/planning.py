"""Planning: the experiments of the params file (params `experiments`, its one reader), each checked against the
methods, partition schemes and train keys, and resolved into its plan, checked against the registries (strategies,
KD gates, privacy's refusals) before the first plan file is written. A plan holds exactly what its experiment's result
depends on (pipeline.experiments.plans reads it back; docs/ARCHITECTURE.md, "Experiments, plans and run-time
settings")."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, Literal

from pipeline.common import atomic
from pipeline.common.config import ConfigError, config, from_dict, group
from pipeline.common.integrity import file_hash
from pipeline.experiments.entries import Experiment, Inherited, privacy_label
from pipeline.experiments.methods import METHODS, STRATEGY_KEYS, MethodSpec, get_method, get_strategy
from pipeline.experiments.model import MODEL_RESULT_KEYS, ModelConfig
from pipeline.experiments.privacy import client_level_problem, secure_aggregation_refusal
from pipeline.experiments.settings import RUN_TRAIN_KEYS, CacheConfig, check_run_keys
from pipeline.experiments.train_config import TRAIN_KEYS, TrainConfig, train_config
from pipeline.federation.strategies.catalog import BUILDERS
from pipeline.modeling.cache import DTYPES
from pipeline.modeling.gates.catalog import GATES, gate_of
from pipeline.modeling.losses import KDConfig
from pipeline.partitioning.schemes import SCHEMES, PartitionConfig, scheme_client_names
from pipeline.paths import PATHS

RESERVED_NAMES = {PATHS.plans.name, PATHS.backbone.name}  # directories under models/ that are not experiments
ENTRY_KEYS = ("method", "partition", "seed", "study", "tau")
PRIVACY_KEY = "privacy"  # an entry's overrides of params `privacy` (a privacy-utility study in one experiment)
# params.yaml's top level: a group a stage reads, or a value entries inherit (a misspelt group is refused, not skipped)
PARAMS_KEYS = ("tau", "seed", "ingest", "examples", "partition", "backbone", "model", "train", "privacy")
PARAMS_KEYS += ("experiments", "evaluate", "bootstrap", "postag", "analyze", "report")


@config(frozen=True)
class ModelGroup(ModelConfig, CacheConfig):
    """params `model` whole: the model's shape (a plan carries it), the cache's keys and its entries' dtype."""

    cache_dtype: Literal[tuple(DTYPES)] = "float32"  # a plan carries it unless float32 (a float16 prefix is rounded)


def parse_entry(name: str, raw: dict[str, Any], params: dict[str, Any], file: str = "params.yaml") -> Experiment:
    """An experiments entry: known keys plus flat `train` overrides (e.g. ``fraction_train: 0.67``)."""
    where = f"{file} experiments.{name}"
    # one argument of the train stage's shell command (dvc.yaml: --experiment ${key}) and one folder in models/
    if not isinstance(name, str) or not re.fullmatch(r"\w[\w.-]*", name) or name in RESERVED_NAMES:
        raise ConfigError(
            f"{file} experiments: invalid experiment name {name!r} (a string of letters, digits, '_', '-' and '.', "
            f"starting with a letter or digit, not one of {sorted(RESERVED_NAMES)}: those are directories under models/)"
        )
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    train_fields = TRAIN_KEYS | set(RUN_TRAIN_KEYS)
    overrides = {k: v for k, v in raw.items() if k not in ENTRY_KEYS and k != PRIVACY_KEY}
    if unknown := sorted(set(overrides) - train_fields):
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}; allowed: {list(ENTRY_KEYS)}, {PRIVACY_KEY} (a mapping from "
            f"{file}'s privacy keys to the entry's values) and the train keys {sorted(train_fields)}"
        )
    check_run_keys(overrides, where)  # its run-time keys: left out of its plan, its train stage reads them
    reads_tau = getattr(METHODS.get(str(raw.get("method"))), "uses_tau", False)
    tau, train = raw.get("tau"), group(params, "train", file) | overrides  # the entry's train keys win
    entry = {k: raw[k] for k in ("method", "partition", "study") if k in raw} | {
        "name": str(name),
        "seed": raw.get("seed", params.get("seed", 0)),
        "tau": params.get("tau") if tau is None and reads_tau else tau,
        "train": overrides,
        "privacy": raw.get(PRIVACY_KEY) or {},
        **{key: train[key] for key in ("tau_scale", "entropy_log_base", "kd_gate") if key in train},  # the gate's
    }
    exp = from_dict(Experiment, entry, where)
    if exp.scheme not in SCHEMES:
        raise ConfigError(f"{where}.partition: unknown partition scheme {exp.scheme!r}; allowed: {sorted(SCHEMES)}")
    method = get_method(exp.method)
    if unread := sorted(set(overrides) & _unread(method)):  # its plan would be the same without them
        raise ConfigError(f"{where}: train key(s) {unread} set, but method {method.name!r} does not read them")
    resolved = exp.privacy_config(params, file)  # checks the entry's privacy keys and values
    if exp.privacy and (resolved.enabled or resolved.secure_aggregation) and not method.federated:
        raise ConfigError(
            f"{where}.{PRIVACY_KEY}: method {method.name!r} sends nothing (privacy applies to federated methods)"
        )
    return dataclasses.replace(exp, dp=privacy_label(resolved) if method.federated else "")


def declared(params: dict[str, Any], file: str = "params.yaml") -> list[Experiment]:
    """Every experiment of the params ``file``, in its order, each checked (the first bad entry raises, naming it)."""
    train = group(params, "train", file)  # what entries inherit, first: RunSettings' keys and TrainConfig's
    check_run_keys(train, f"{file} train")
    train_config({k: v for k, v in train.items() if k not in RUN_TRAIN_KEYS}, f"{file} train")
    from_dict(Inherited, {key: params[key] for key in ("seed", "tau") if key in params}, file, sep=" ")
    return [parse_entry(name, raw, params, file) for name, raw in group(params, "experiments", file).items()]


def _unread(method: MethodSpec) -> set[str]:
    """The `train` keys ``method`` never reads: left out of its plan, and an entry of it may not set them."""
    rules = (  # (whether it applies, the keys it leaves out)
        (method.kd_mode == "ce", ("kd_lambda", "kd_temperature", "kd_direction", "entropy_log_base")),
        (method.kd_mode != "selective", ("entropy_log_base", "tau_scale", "kd_gate")),
        (method.new_client != "post", ("new_client", "join")),  # only a late joiner is named (pre: all from round 1)
        (not method.federated, ("local_adapter", "fraction_train", "weight_by", "transfer_dtype", "transfer_delta")),
        (not method.pooled, ("centralized_steps",)),  # the pooled training set's round size (AdaCentralized)
        (method.local_from_global, ("local_adapter",)),  # the server average overwrites the adapter whatever this says
    )
    own = get_strategy(method.strategy).params_keys if method.strategy is not None else ()
    return {key for applies, keys in rules if applies for key in keys} | (STRATEGY_KEYS - set(own))


def _relevant_train(train: TrainConfig, method: MethodSpec) -> dict[str, Any]:
    """The plan's `train` mapping: the keys that only matter for some methods are left out of other methods' plans,
    so changing them does not rerun experiments whose result cannot change."""
    out = dataclasses.asdict(train)
    strategy_params = out.pop("strategy_params")
    rules = (  # (whether it applies, the keys it leaves out) by the values, beside those its method never reads
        (train.kd_gate == "entropy", ("kd_gate",)),  # the paper's gate: plans as before
        (not train.stop.enabled, ("stop",)),  # a fixed number of rounds: plans as before train.stop existed
        (train.transfer_dtype == "fp32", ("transfer_delta",)),  # fp32 sends the weights themselves, exactly
        # no cap: the trained count is the full train size
        (train.max_train_examples_per_client is None, ("weight_by",)),
    )
    drop = _unread(method) | {key for applies, keys in rules if applies for key in keys}
    if method.strategy is not None:  # the settings of this method's strategy only (its own params keys)
        out.update(get_strategy(method.strategy).plan_entries(strategy_params))
    return {k: v for k, v in out.items() if k not in drop}


def resolve_plan(exp: Experiment, params: dict[str, Any], file: str = "params.yaml") -> dict[str, Any]:
    """The resolved configuration of one experiment (what its train stage reads)."""
    method, where = get_method(exp.method), f"{file} experiments.{exp.name}"
    t = group(params, "train", file)  # an entry's mappings (stop, join, fedopt) merge key by key, like privacy.secagg
    merged = t | {k: t[k] | v if isinstance(v, dict) and type(t.get(k)) is dict else v for k, v in exp.train.items()}
    train = train_config({k: v for k, v in merged.items() if k not in RUN_TRAIN_KEYS}, f"{where} train")
    if train.kd_gate not in GATES:
        at = f"{where}: train" if "kd_gate" in exp.train else f"{file} train"  # the entry's own, else params'
        raise ConfigError(f"{at}.kd_gate {train.kd_gate!r} is not a KD gate; expected one of {sorted(GATES)}")
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
            exp.scheme, from_dict(PartitionConfig, params.get("partition"), f"{file} partition")
        )
    if train.prefix_cache and model.get("cache_dtype", "float32") != "float32":
        plan["cache_dtype"] = model["cache_dtype"]  # a float16/bfloat16 prefix changes the logits; float32 is exact
    if method.new_client == "post" and train.join.max_round > train.rounds:
        raise ConfigError(
            f"{where}: train.join.max_round {train.join.max_round} > rounds {train.rounds}: the new "
            f"client might never join"
        )
    if method.uses_tau:
        plan["tau"] = exp.tau
        # the loss's own check of tau against train.tau_scale, at plan time rather than in training
        from_dict(KDConfig, {"tau": exp.tau, "tau_scale": train.tau_scale, "kd_gate": train.kd_gate}, where)
    privacy = exp.privacy_config(params, file)
    if privacy.mode == "client" and (problem := client_level_problem(method, train.transfer_dtype, privacy)):
        raise ConfigError(f"{where}: privacy.mode client: {problem}")
    if privacy.secure_aggregation and (refusal := secure_aggregation_refusal(method, train.transfer_dtype, privacy)):
        raise ConfigError(f"{where}: privacy.secure_aggregation: {refusal}")
    if (privacy.enabled or privacy.secure_aggregation) and method.federated:
        if privacy.mode == "example" and method.kd_mode == "selective" and train.tau_scale == "batch_quantile":
            # the gate of every token would depend on the other examples of its batch: no per-example bound
            raise ConfigError(
                f"{where}: privacy.mode {privacy.mode} needs a per-example loss, but train.tau_scale batch_quantile "
                f"gates each token by a quantile over the whole batch; use absolute or max_entropy"
            )
        plan["privacy"] = privacy.plan_dict()
    if method.new_client == "post" and train.new_client not in plan.get("clients", [train.new_client]):
        raise ConfigError(f"{where}: train.new_client={train.new_client!r}; allowed: one of {plan['clients']}")
    if method.uses_postags and PATHS.postags.exists():
        # The POS tags enter the result only here; their hash makes this plan (alone) change when they do.
        plan["postags_md5"] = file_hash(PATHS.postags, "md5")
    # md5 of the source of the strategy module and the KD gate module the method runs, by module name
    if used := [f for f in (BUILDERS.get(method.strategy), gate_of(method.kd_mode, train.kd_gate)) if f is not None]:
        plan["extension_md5"] = {f.__module__: file_hash(Path(sys.modules[f.__module__].__file__), "md5") for f in used}
    return plan


def check_params(params: dict[str, Any], file: str = "params.yaml") -> dict[str, dict[str, Any]]:
    """Every experiment's plan, each group it reads checked (the first problem raises ConfigError naming it)."""
    if unknown := [str(key) for key in params if key not in PARAMS_KEYS]:
        raise ConfigError(f"{file}: unknown top-level key(s) {unknown}; the groups are {', '.join(PARAMS_KEYS)}")
    # Checked here, before any plan is written, although only the train stage builds the model from it.
    from_dict(ModelGroup, group(params, "model", file), f"{file} model")  # its cache keys (CacheConfig's) too
    part = from_dict(PartitionConfig, params.get("partition"), f"{file} partition")
    for exp in (experiments := declared(params, file)):  # its train stage's dep data/partitions/<partition>.json
        if exp.partition not in {f"{scheme}/seed{seed}" for scheme in part.schemes for seed in part.seeds}:
            raise ConfigError(
                f"{file} experiments.{exp.name}.partition: {exp.partition!r} is not produced by "
                f"partition.schemes {part.schemes} x partition.seeds {part.seeds}"
            )
    return {exp.name: resolve_plan(exp, params, file) for exp in experiments}


def write_plans(plans: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """``plans`` (:func:`check_params`'s: every experiment checked before the first is written, so a bad entry leaves
    the old plans as they were) as ``<out_dir>/<experiment>.json``."""
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
