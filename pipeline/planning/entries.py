"""What the experiments are: the entries of params `experiments`, each checked against the methods, partition schemes
and train keys (docs/ARCHITECTURE.md, "Experiments, plans and run-time settings")."""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeline.common.config import ConfigError, group
from pipeline.experiments.entries import Experiment, privacy_label
from pipeline.experiments.methods import get_method
from pipeline.experiments.privacy import PrivacyConfig
from pipeline.experiments.settings import RUN_TRAIN_KEYS
from pipeline.experiments.train_config import train_keys
from pipeline.partitioning.schemes import SCHEMES

RESERVED_NAMES = {"plans", "backbone"}  # directories under models/ that are not experiments
ENTRY_KEYS = ("method", "partition", "seed", "study", "tau")
PRIVACY_KEY = "privacy"  # an entry's overrides of params `privacy` (a privacy-utility study in one experiment)


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


def declared(params: dict[str, Any]) -> list[Experiment]:
    """Every experiment of the params file, in its order, each checked (the first bad entry raises, naming it)."""
    return [parse_entry(name, raw, params) for name, raw in group(params, "experiments").items()]
