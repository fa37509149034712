"""What the experiments are: the entries of params `experiments`, each checked, and their display labels
(docs/ARCHITECTURE.md, "Experiments, plans and run-time settings")."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.common.config import NonNegativeInt, config, from_dict, group
from pipeline.experiments.methods import METHODS, get_method
from pipeline.experiments.privacy import PrivacyConfig
from pipeline.experiments.train_config import LogBase, TauScale

# > 0: the entropy gate is H(q_g) < tau with H >= 0, so tau <= 0 would never distil; inf: KD on every token
Tau = Annotated[float, Field(gt=0.0, allow_inf_nan=True)]
TAU_STUDY = "tau_sweep"  # the study whose runs analyze plots by their tau (pipeline.results.analysis)


@config(frozen=True)
class Inherited:
    """params.yaml's top-level `seed` and `tau`: those of every entry that sets none (tau: of the methods that read
    it), checked as such, so that a bad one is named as the top-level key and not as the first entry inheriting it."""

    seed: NonNegativeInt = 0
    tau: Tau | None = None


@config(frozen=True)
class Experiment:
    """One entry of params `experiments`, checked (its keys' types, its method, the form of its partition and
    whether its method reads tau: a tau sweep's must), with its tau resolved as its plan has it."""

    name: str
    method: Literal[tuple(sorted(METHODS))]  # type: ignore[valid-type]
    partition: str  # "<scheme>/seed<k>"
    seed: NonNegativeInt = 0  # numpy's generators (AdaCentralized's round window) refuse a negative seed
    study: str = "main"
    tau: Tau | None = None  # the entry's tau, else the top-level tau for methods that read it, else None
    train: dict[str, Any] = field(default_factory=dict)  # the entry's overrides of params `train`
    tau_scale: TauScale = "absolute"  # how the gate reads tau: the entry's train.tau_scale, else the params file's
    entropy_log_base: LogBase = "e"  # the unit of H(q_g) and an absolute tau ("2": bits), resolved as tau_scale is
    privacy: dict[str, Any] = field(default_factory=dict)  # the entry's overrides of params `privacy`
    dp: str = ""  # the privacy it trains with, in words (privacy_label; "" = none)
    kd_gate: str = "entropy"  # selective KD's gate (tau its threshold; only "entropy" reads tau as an entropy)

    @field_validator("partition")
    @classmethod
    def _scheme_and_seed(cls, partition: str) -> str:
        if not partition.partition("/seed")[2].isdigit():
            raise ValueError(f"must look like '<scheme>/seed<k>', got {partition!r}")
        return partition

    @model_validator(mode="after")
    def _tau_if_read(self) -> Experiment:
        if get_method(self.method).uses_tau and self.tau is None:
            raise ValueError(f"method {self.method!r} needs tau (the entry's, or the top-level tau)")
        if not get_method(self.method).uses_tau and self.tau is not None:
            raise ValueError(f"tau is set but method {self.method!r} does not use it")
        if self.study == TAU_STUDY and self.tau is None:  # its method reads no tau (a tau-reading one has one)
            raise ValueError(f"a tau-sweep experiment needs a method that reads tau; {self.method!r} reads none")
        return self

    @property
    def scheme(self) -> str:
        return self.partition.partition("/seed")[0]

    @property
    def variant(self) -> str:
        """The entry's train overrides as text, e.g. "fraction_train=0.67" ("" when none)."""
        return ",".join(f"{k}={self.train[k]}" for k in sorted(self.train))

    def privacy_config(self, params: dict[str, Any], file: str = "params.yaml") -> PrivacyConfig:
        """params `privacy` (of the params ``file``) with this entry's overrides (`secagg` merged key by key)."""
        base = group(params, "privacy", file)
        merged = {**base, **self.privacy}
        if isinstance(base.get("secagg"), dict) and isinstance(self.privacy.get("secagg"), dict):
            merged["secagg"] = {**base["secagg"], **self.privacy["secagg"]}
        return from_dict(
            PrivacyConfig, merged, f"{file} experiments.{self.name} privacy" if self.privacy else f"{file} privacy"
        )


def privacy_label(privacy: PrivacyConfig) -> str:
    """The privacy a run trains with, in words for tables and figures: "" (none), "DP-SGD ε≤3 δ≤1e-5" (a target,
    with the delta it holds at: mode example's default is at most 1e-5, an explicit one is given as is) or
    "DP-SGD σ=1.1" (a noise multiplier); other modes by their name; "+ SecAgg+" (or "SecAgg+" alone) under
    secure aggregation."""
    parts = []
    if privacy.enabled:
        name = {"example": "DP-SGD", "client": "client-level DP"}.get(privacy.mode, f"DP {privacy.mode}")
        if privacy.target_epsilon is not None:
            default = "δ≤1e-05" if privacy.mode == "example" else "δ=1e-05"  # pipeline.privacy.accounting's
            delta = f"δ={privacy.delta:g}" if privacy.delta is not None else default
            parts.append(f"{name} ε≤{privacy.target_epsilon:g} {delta.replace('e-0', 'e-')}")
        else:
            parts.append(f"{name} σ={privacy.noise_multiplier:g}")
    if privacy.secure_aggregation:
        parts.append("SecAgg+")
    return " + ".join(parts)


def with_labels(experiments: list[Experiment]) -> dict[str, str]:
    """A display label per experiment: the method, plus whatever else varies within its study (tau, overrides,
    partition scheme), so one study's configurations are told apart without hard-coding study layouts."""
    labels = {}
    for study in dict.fromkeys(e.study for e in experiments):
        members = [e for e in experiments if e.study == study]
        varying = [attr for attr in ("scheme", "tau", "variant", "dp") if len({getattr(e, attr) for e in members}) > 1]
        for e in members:
            values = [(attr, getattr(e, attr)) for attr in varying]
            parts = [e.method] + [f"tau={v:g}" if attr == "tau" else v for attr, v in values if v not in (None, "")]
            labels[e.name] = " ".join(str(x) for x in parts)
    return labels
