"""The privacy package's door: the calls a run makes where a privacy mode changes something, so that what it changes
stays in pipeline/privacy/ (a run without privacy gets ``None`` back), and the run's privacy records (metrics.json,
MLflow). Importing this module registers them into pipeline.training.privacy_hooks, through which training and
federation call them (they do not import privacy); the entry points that build runs import it."""

from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import asdict
from typing import Any

from flwr.app import MetricRecord
from flwr.client.mod import make_ffn

from pipeline.common.config import ConfigError
from pipeline.experiments.privacy import client_level_problem, secure_aggregation_refusal
from pipeline.federation.protocol import DP_METRICS, load_plan, plan_path_of
from pipeline.privacy.accounting import bound, client_privacy, secure_sum_problem, server_setting
from pipeline.privacy.client_dp import ClientLevelDP, client_dp_mod
from pipeline.privacy.example_dp import DPSGDSteps
from pipeline.privacy.secure_aggregation import SecureAggregator, is_legacy_fit, legacy_fit, secure_aggregation_mod
from pipeline.training import checkpoints
from pipeline.training.client_data import read_partition
from pipeline.training.privacy_hooks import register_privacy

STEPS_KEY = "privacy"  # a client's context.state: its DP-SGD steps over all rounds so far (the accountant's history)


def local_steps(plan, module, examples, seed: int, client: str, micro_batches, proximal=None) -> DPSGDSteps | None:
    """Mode example: the DP-SGD step object of ``client``'s round (``micro_batches(frame)``: a step's sample cut into
    (micro-batch, per-example loss scale) pairs); else None."""
    if plan.privacy is None or plan.privacy.mode != "example":
        return None
    setting = client_privacy(plan, len(examples), f"{plan.source}: client {client!r}")
    return DPSGDSteps(module, setting, seed, examples, micro_batches, proximal)


def check_run(plan, sizes: dict[str, dict[str, int]] | None = None) -> None:
    """Refuse, before anything trains, a delta of 1/n or more or an unreachable target epsilon; ``sizes``: the train
    sizes the clients reported at admission (a deployed server holds no partition; client_level checks mode client)."""
    cfg = plan.privacy
    if cfg is None or not cfg.enabled or not plan.spec.federated or (sizes is not None and cfg.mode == "client"):
        return
    if sizes is None:
        sizes = {
            c: {"num-train": len(s["train"])} for c, s in read_partition(plan.paths["partition"])["clients"].items()
        }
    where, cap = plan.source or plan.experiment, plan.train.max_train_examples_per_client
    if cfg.mode == "client":
        server_setting(plan, len(sizes))
    for name, n in [(c, s["num-train"]) for c, s in sizes.items() if "num-train" in s] if cfg.mode == "example" else []:
        client_privacy(plan, n if cap is None else min(n, cap), f"{where}: client {name!r}")


def client_level(plan, strategy, population: int):
    """Under privacy.mode client the DP strategy around ``strategy`` (also the round record), else None."""
    if plan.privacy is None or plan.privacy.mode != "client":
        return None
    problem = client_level_problem(plan.spec, plan.train.transfer_dtype, plan.privacy)
    if problem:  # the plan stage refuses it; a plan file written by hand is refused here
        raise ValueError(f"{plan.source}: privacy.mode client: {problem}")
    releases = checkpoints.checkpoint_dir(plan) / checkpoints.DP_RELEASES if plan.spec.local_from_global else None
    return ClientLevelDP(strategy, plan, server_setting(plan, population), releases)


def secure_aggregator(
    plan, clients: list[str], late: str | None, timeout: float, sizes: dict[str, dict[str, int]] | None = None
):
    """The plan's SecAgg+ round runner (``late``: the client that joins later; ``sizes``: the train sizes the
    clients reported at admission, else the partition file's)."""
    if plan.privacy is None or not plan.privacy.secure_aggregation:
        return None
    refusal = secure_aggregation_refusal(plan.spec, plan.train.transfer_dtype, plan.privacy)
    if refusal is not None:  # a plan file written by hand: the plan stage refuses it already
        raise ValueError(f"{plan.source or plan.experiment}: privacy.secure_aggregation: {refusal}")
    first = len([c for c in clients if c != late])
    try:  # a plan file written by hand (the plan stage refuses these already): one line, exit 2
        if problem := secure_sum_problem(plan.privacy.secagg, len(clients), first, plan.train.fraction_train):
            raise ValueError(problem)
        if plan.privacy.mode == "client":  # uniform weights (the mean the noise is calibrated to), clipped bits summed
            return SecureAggregator(plan.privacy.secagg, 1, timeout, clipped_bits=True)
        # The largest FedAvg weight a client can report (its train size, capped under train.weight_by: trained; a
        # looser one scales Flower's integer weights down and the error up: pipeline.privacy.secure_aggregation).
        reported = [sizes.get(c, {}).get("num-train") for c in clients] if sizes else [None]
        if None in reported:
            reported = [len(c["train"]) for c in read_partition(plan.paths["partition"])["clients"].values()]
        cap = plan.train.max_train_examples_per_client if plan.train.weight_by == "trained" else None
        return SecureAggregator(plan.privacy.secagg, max(min(n, cap or n) for n in reported), timeout)
    except ValueError as exc:
        raise ConfigError(f"{plan.source or plan.experiment}: {exc}") from None


def client_train(msg, context, train_round):
    """The ClientApp's train handler inside privacy's Flower mods, SecAgg+'s and client-level DP's clipping (each
    passes a message through unless its plan asks for it). SecAgg+'s legacy FitIns go through client-level DP's
    clipping mod before the masking. The client, not the server, decides whether its adapter may leave in the clear:
    under ``privacy.secure_aggregation`` it refuses a plain train message."""

    def checked_train(msg, context):
        if is_legacy_fit(msg):
            return legacy_fit(msg, context, lambda m, c: client_dp_mod(m, c, train_round))
        plan = load_plan(plan_path_of(msg, context))
        if plan.privacy is not None and plan.privacy.secure_aggregation:
            raise ValueError(
                f"{plan.experiment}: the plan sets privacy.secure_aggregation; this client uploads "
                f"its adapter only through SecAgg+"
            )
        return train_round(msg, context)

    return make_ffn(checked_train, [secure_aggregation_mod, client_dp_mod])(msg, context)


def dp_steps(context) -> int | None:
    """A client's DP-SGD steps across rounds (in its ``context.state`` and checkpoints: a restarted one composes
    on); None when it has taken no step under DP (its checkpoint then records none)."""
    return int(context.state[STEPS_KEY]["steps"]) if STEPS_KEY in context.state else None


def restore_dp_steps(context, steps: int | None) -> None:
    if steps is not None:
        context.state[STEPS_KEY] = MetricRecord({"steps": int(steps)})


def account(context, result) -> dict[str, float | int]:
    """The round's privacy reply metrics (-1: unbounded), epsilon over every DP-SGD step so far."""
    setting = result.privacy
    if setting is None:
        return {}
    total = (dp_steps(context) or 0) + int(result.n_steps)
    restore_dp_steps(context, total)
    eps = bound(setting.noise_multiplier, setting.sample_rate, total, setting.delta, setting.accountant)[0]
    values = vars(result) | vars(setting) | {"epsilon": eps, "dp_steps": total}
    return {
        key: -1.0 if values[field] == math.inf else kind(values[field]) for key, (field, kind, *_) in DP_METRICS.items()
    }


def run_record(plan, history: list[dict[str, Any]], clients: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Fill ``clients.<c>.privacy``; metrics.json's ``privacy`` and, under SecAgg+ only, ``secure_aggregation``."""
    for name, c in clients.items():
        dp_rows = [r for r in history if r["client"] == name and "dp_steps" in r]
        if dp_rows:  # epsilon after the client's last training round (the accountant composes every step)
            last = max(dp_rows, key=lambda r: r["dp_steps"])
            examples = sum(r["dp_examples"] for r in dp_rows)
            c["privacy"] = {k: last[k] for k in ("epsilon", "delta", "noise_multiplier", "max_grad_norm")} | {
                "clipped_fraction": sum(r["dp_clipped"] for r in dp_rows) / examples if examples else 0.0,
                "steps": last["dp_steps"],
                "sample_rate": last["sample_rate"],
            }
    cfg, privacy = plan.privacy, None
    if cfg is not None and cfg.mode == "client":
        privacy = client_level_summary(plan, history, clients)
    elif cfg is not None and cfg.enabled:
        reports = [c["privacy"] for c in clients.values() if "privacy" in c]
        eps = [r["epsilon"] for r in reports]
        top = None if (not eps or None in eps) else max(reports, key=lambda r: r["epsilon"])
        # the accountant that gave epsilon_max: RDP where PRV has no finite bound (accounting.bound)
        at = (top["noise_multiplier"], top["sample_rate"], top["steps"], top["delta"]) if top else None
        # epsilon_max holds at delta_max: each client's (epsilon, delta) holds, so does the pair of the largest
        privacy = {
            "mode": cfg.mode,
            "accountant": bound(*at, cfg.accountant)[1] if top else cfg.accountant,
            "sampling": "poisson",
            "target_epsilon": cfg.target_epsilon,
            "epsilon_max": top["epsilon"] if top else None,
            "delta_max": max((r["delta"] for r in reports), default=None),
        }
    record = {"privacy": privacy}
    if cfg is not None and cfg.secure_aggregation:
        sampled = [r for r in history if r.get("sampled")]
        record["secure_aggregation"] = {
            "protocol": "SecAgg+ (flwr SecAggPlusWorkflow)",
            **asdict(cfg.secagg),
            "rounds_aggregated": len({r["round"] for r in sampled if not r.get("failed")}),
            "dropped": dict(Counter(r["client"] for r in sampled if r.get("failed"))),
            "clipped_coordinates": sum(int(r.get("secagg_clipped", 0)) for r in sampled),
        }
    return record


def client_level_summary(plan, history: list[dict[str, Any]], clients: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """privacy.mode client: the run's guarantee (the same for every client) and each client's share of clipped
    updates in ``clients.<c>.privacy`` (not under SecAgg+: the server knows only each round's count)."""
    cfg, released = plan.privacy, [r for r in history if "update_clipped" in r]
    for name, c in clients.items():
        if own := [r["update_clipped"] for r in released if r["client"] == name]:
            c["privacy"] = {"updates_aggregated": len(own)} | (
                {} if cfg.secure_aggregation else {"clipped_fraction": sum(own) / len(own)}
            )
    last = max(released, key=lambda r: r["round"]) if released else None
    rounds_run = max((int(r["round"]) for r in history), default=0)
    accounted = max((int(r.get("rounds_accounted", r["round"])) for r in history), default=0)  # a round redone: +1
    # Every round run consumed budget, an empty Poisson sample too: the accountant composes them all.
    setting = server_setting(plan, len({r["client"] for r in history})) if history else None
    epsilon, accountant = setting.bound_after(accounted) if setting is not None else (0.0, cfg.accountant)
    epsilon = None if epsilon == float("inf") else epsilon  # noise multiplier 0: no bound
    return {
        "mode": "client",
        "accountant": accountant,  # the one that gave epsilon (RDP where PRV has no finite bound)
        "sampling": "poisson",  # each client joins a round independently with probability sample_rate
        "clipping": cfg.clipping,
        "clipping_side": cfg.clipping_side,
        "target_epsilon": cfg.target_epsilon,
        "epsilon": epsilon,
        "epsilon_max": epsilon,
        "delta": setting.delta if setting else None,
        "noise_multiplier": setting.noise_multiplier if setting else None,
        "clipping_norm": last["clipping_norm"] if last else None,
        "clipped_fraction": sum(r["update_clipped"] for r in released) / len(released) if released else 0.0,
        "sample_rate": setting.sample_rate if setting else None,
        "rounds_accounted": accounted,
        "rounds_empty": len(set(range(1, rounds_run + 1)) - {int(r["round"]) for r in history if r.get("sampled")}),
        "rounds_released": len({r["round"] for r in released}),
        "updates_aggregated": len(released),
    }


def mlflow_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """MLflow metrics: the clients' DP-SGD reports (``<client>.run/epsilon`` ...; unbounded ones left out) or the
    run's client-level guarantee (``run/epsilon`` ...; ``run/``: not the per-round keys, logged at the same last
    step), ``epsilon_max`` (``delta_max``), and secure aggregation's (``secagg.*``)."""
    run = metrics.get("privacy") or {}
    if run.get("mode") == "client":
        fields = ("epsilon", "delta", "noise_multiplier", "clipping_norm", "clipped_fraction")
        out = {f"run/{k}": float(run[k]) for k in fields if run.get(k) is not None}
    else:
        fields = ("epsilon", "delta", "noise_multiplier", "max_grad_norm", "clipped_fraction")
        reports = {c: v["privacy"] for c, v in metrics["clients"].items() if "privacy" in v}
        out = {f"{c}.run/{k}": r[k] for c, r in reports.items() for k in fields if r[k] is not None}
    out |= {k: float(run[k]) for k in ("epsilon_max", "delta_max") if run.get(k) is not None}
    if sa := metrics.get("secure_aggregation"):
        out |= {
            "secagg.rounds_aggregated": sa["rounds_aggregated"],
            "secagg.dropped": sum(sa["dropped"].values()),
            "secagg.clipped_coordinates": sa["clipped_coordinates"],
        }
    return out


register_privacy(sys.modules[__name__])  # each of its calls privacy_hooks names
