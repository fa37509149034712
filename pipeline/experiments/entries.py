"""What the experiments are: the entries of params `experiments`, each checked, and their display labels
(docs/ARCHITECTURE.md, "Experiments, plans and run-time settings").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pipeline.common.config import ConfigError, from_dict, group
from pipeline.experiments.settings import RUN_TRAIN_KEYS
from pipeline.partitioning.schemes import SCHEMES
from pipeline.privacy.settings import PrivacyConfig
from pipeline.training.config import train_keys
from pipeline.training.methods import get_method

RESERVED_NAMES = {"plans", "backbone"}  # directories under models/ that are not experiments
ENTRY_KEYS = ("method", "partition", "seed", "study", "tau")
PRIVACY_KEY = "privacy"  # an entry's overrides of params `privacy` (a privacy-utility study in one experiment)


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
