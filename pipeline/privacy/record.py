"""What a run records of its privacy (metrics.json and MLflow): each client's DP-SGD report (mode example), the
run's client-level guarantee (mode client), the SecAgg+ settings and dropouts. Every epsilon goes with its delta,
and the run's record names the sampling and the accountant."""
from __future__ import annotations

from dataclasses import asdict as to_dict
from typing import Any

from pipeline.privacy.client_dp import server_setting

# A client's DP-SGD report in metrics.json and MLflow (pipeline.privacy; None = unbounded)
PRIVACY_FIELDS = ("epsilon", "delta", "noise_multiplier", "max_grad_norm", "clipped_fraction")
# privacy.mode client: the run's report (one guarantee for every client), in metrics.json's `privacy` and MLflow
CLIENT_LEVEL_FIELDS = ("epsilon", "delta", "noise_multiplier", "clipping_norm", "clipped_fraction")


def run_record(plan, history: list[dict[str, Any]], clients: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Fill ``clients.<c>.privacy`` from the history rows and return metrics.json's ``privacy`` (None without
    privacy) and, under SecAgg+ only, ``secure_aggregation`` (runs without it keep their layout)."""
    for name, c in clients.items():
        dp_rows = [r for r in history if r["client"] == name and "dp_steps" in r]
        if dp_rows:  # epsilon after the client's last training round (the accountant composes every step)
            last = max(dp_rows, key=lambda r: r["dp_steps"])
            examples = sum(r["dp_examples"] for r in dp_rows)
            c["privacy"] = {
                "epsilon": last["epsilon"], "delta": last["delta"], "noise_multiplier": last["noise_multiplier"],
                "max_grad_norm": last["max_grad_norm"],
                "clipped_fraction": sum(r["dp_clipped"] for r in dp_rows) / examples if examples else 0.0,
                "steps": last["dp_steps"], "sample_rate": last["sample_rate"],
            }
    privacy = None
    if plan.privacy is not None and plan.privacy.mode == "client":
        privacy = client_level_summary(plan, history, clients)
    elif plan.privacy is not None and plan.privacy.enabled:
        eps = [c["privacy"]["epsilon"] for c in clients.values() if "privacy" in c]
        deltas = [c["privacy"]["delta"] for c in clients.values() if "privacy" in c]
        # epsilon_max holds at delta_max: each client's (epsilon, delta) holds, so does the pair of the largest
        privacy = {"mode": plan.privacy.mode, "accountant": plan.privacy.accountant,
                   "sampling": "poisson",
                   "target_epsilon": plan.privacy.target_epsilon,
                   "epsilon_max": None if (not eps or None in eps) else max(eps),
                   "delta_max": max(deltas) if deltas else None}
    secure = secure_aggregation_summary(plan, history)
    return {"privacy": privacy, **({"secure_aggregation": secure} if secure is not None else {})}


def client_level_summary(plan, history: list[dict[str, Any]], clients: dict[str, dict[str, Any]]
                         ) -> dict[str, Any]:
    """privacy.mode client: the run's guarantee after its last released round (the same for every client), and
    each client's share of clipped updates (``clients.<c>.privacy``; under SecAgg+ the server knows only each
    round's count: the rows carry the round's fraction, and a client's own share is not reported)."""
    released = [r for r in history if "update_clipped" in r]
    secure = plan.privacy.secure_aggregation
    for name, c in clients.items():
        own = [r["update_clipped"] for r in released if r["client"] == name]
        if own:
            c["privacy"] = {"updates_aggregated": len(own)} | (
                {} if secure else {"clipped_fraction": sum(own) / len(own)})
    last = max(released, key=lambda r: r["round"]) if released else None
    cfg = plan.privacy
    rounds_run = max((int(r["round"]) for r in history), default=0)
    sampled_rounds = {int(r["round"]) for r in history if r.get("sampled")}
    # Every round run consumed budget, an empty Poisson sample too: the accountant composes them all.
    setting = server_setting(plan, len({r["client"] for r in history})) if history else None
    epsilon = setting.epsilon_after(rounds_run) if setting is not None else 0.0
    epsilon = None if epsilon == float("inf") else epsilon  # noise multiplier 0: no bound
    return {"mode": "client", "accountant": cfg.accountant,
            "sampling": "poisson",  # each client joins a round independently with probability sample_rate
            "clipping": cfg.clipping, "clipping_side": cfg.clipping_side, "target_epsilon": cfg.target_epsilon,
            "epsilon": epsilon, "epsilon_max": epsilon, "delta": setting.delta if setting else None,
            "noise_multiplier": setting.noise_multiplier if setting else None,
            "clipping_norm": last["clipping_norm"] if last else None,
            "clipped_fraction": sum(r["update_clipped"] for r in released) / len(released) if released else 0.0,
            "sample_rate": setting.sample_rate if setting else None, "rounds_accounted": rounds_run,
            "rounds_empty": len(set(range(1, rounds_run + 1)) - sampled_rounds),
            "rounds_released": len({r["round"] for r in released}), "updates_aggregated": len(released)}


def secure_aggregation_summary(plan, history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Under privacy.secure_aggregation: the SecAgg+ settings, the rounds whose sum was unmasked, the sampled
    clients left out of a sum (dropped, or the whole round when it could not be unmasked), and the upload
    coordinates SecAgg+ clipped (0 keeps the aggregate within its quantisation bound)."""
    if plan.privacy is None or not plan.privacy.secure_aggregation:
        return None
    sampled = [r for r in history if r.get("sampled")]
    dropped: dict[str, int] = {}
    for r in sampled:
        if r.get("failed"):
            dropped[r["client"]] = dropped.get(r["client"], 0) + 1
    return {"protocol": "SecAgg+ (flwr SecAggPlusWorkflow)", **to_dict(plan.privacy.secagg),
            "rounds_aggregated": len({r["round"] for r in sampled if not r.get("failed")}),
            "dropped": dropped, "clipped_coordinates": sum(int(r.get("secagg_clipped", 0)) for r in sampled)}


def mlflow_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The MLflow metrics of the clients' DP-SGD reports (``<client>.epsilon`` ...; unbounded values left out), or
    under privacy.mode client the run's (``epsilon``, ``delta``, ...); and those of secure aggregation
    (``secagg.*``; its settings are the run's parameters ``privacy.secagg.*``)."""
    run = metrics.get("privacy") or {}
    if run.get("mode") == "client":
        out = {k: float(run[k]) for k in CLIENT_LEVEL_FIELDS + ("epsilon_max",) if run.get(k) is not None}
    else:
        out = {f"{c}.{k}": v["privacy"][k] for c, v in metrics["clients"].items() if "privacy" in v
               for k in PRIVACY_FIELDS if v["privacy"][k] is not None}
        if run and run["epsilon_max"] is not None:
            out["epsilon_max"] = run["epsilon_max"]
        if run and run.get("delta_max") is not None:
            out["delta_max"] = run["delta_max"]
    if metrics.get("secure_aggregation"):
        sa = metrics["secure_aggregation"]
        out |= {"secagg.rounds_aggregated": sa["rounds_aggregated"], "secagg.dropped": sum(sa["dropped"].values()),
                "secagg.clipped_coordinates": sa["clipped_coordinates"]}
    return out
