"""What a run records of its privacy (metrics.json and MLflow): each client's DP-SGD report, the run's client-level
guarantee, the SecAgg+ settings and dropouts; every epsilon with its delta, the sampling and accountant named."""
from __future__ import annotations

from collections import Counter
from typing import Any

from pipeline.common.config import to_dict
from pipeline.privacy.accounting import server_setting


def run_record(plan, history: list[dict[str, Any]], clients: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Fill ``clients.<c>.privacy`` from the history rows and return metrics.json's ``privacy`` (None without
    privacy) and, under SecAgg+ only, ``secure_aggregation`` (runs without it keep their layout)."""
    for name, c in clients.items():
        dp_rows = [r for r in history if r["client"] == name and "dp_steps" in r]
        if dp_rows:  # epsilon after the client's last training round (the accountant composes every step)
            last = max(dp_rows, key=lambda r: r["dp_steps"])
            examples = sum(r["dp_examples"] for r in dp_rows)
            c["privacy"] = {k: last[k] for k in ("epsilon", "delta", "noise_multiplier", "max_grad_norm")} | {
                "clipped_fraction": sum(r["dp_clipped"] for r in dp_rows) / examples if examples else 0.0,
                "steps": last["dp_steps"], "sample_rate": last["sample_rate"]}
    cfg, privacy = plan.privacy, None
    if cfg is not None and cfg.mode == "client":
        privacy = client_level_summary(plan, history, clients)
    elif cfg is not None and cfg.enabled:
        reports = [c["privacy"] for c in clients.values() if "privacy" in c]
        eps = [r["epsilon"] for r in reports]
        # epsilon_max holds at delta_max: each client's (epsilon, delta) holds, so does the pair of the largest
        privacy = {"mode": cfg.mode, "accountant": cfg.accountant, "sampling": "poisson",
                   "target_epsilon": cfg.target_epsilon, "epsilon_max": None if (not eps or None in eps) else max(eps),
                   "delta_max": max((r["delta"] for r in reports), default=None)}
    secure = secure_aggregation_summary(plan, history)
    return {"privacy": privacy, **({"secure_aggregation": secure} if secure is not None else {})}


def client_level_summary(plan, history: list[dict[str, Any]], clients: dict[str, dict[str, Any]]
                         ) -> dict[str, Any]:
    """privacy.mode client: the run's guarantee (the same for every client) and each client's share of clipped
    updates in ``clients.<c>.privacy`` (not under SecAgg+: the server knows only each round's count)."""
    cfg, released = plan.privacy, [r for r in history if "update_clipped" in r]
    for name, c in clients.items():
        own = [r["update_clipped"] for r in released if r["client"] == name]
        if own:
            c["privacy"] = {"updates_aggregated": len(own)} | (
                {} if cfg.secure_aggregation else {"clipped_fraction": sum(own) / len(own)})
    last = max(released, key=lambda r: r["round"]) if released else None
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
    clients left out of a sum, and the upload coordinates SecAgg+ clipped (0: within its quantisation bound)."""
    if plan.privacy is None or not plan.privacy.secure_aggregation:
        return None
    sampled = [r for r in history if r.get("sampled")]
    dropped = dict(Counter(r["client"] for r in sampled if r.get("failed")))
    return {"protocol": "SecAgg+ (flwr SecAggPlusWorkflow)", **to_dict(plan.privacy.secagg),
            "rounds_aggregated": len({r["round"] for r in sampled if not r.get("failed")}),
            "dropped": dropped, "clipped_coordinates": sum(int(r.get("secagg_clipped", 0)) for r in sampled)}


def mlflow_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The MLflow metrics of the clients' DP-SGD reports (``<client>.epsilon`` ...; unbounded ones left out) or of
    the run's client-level guarantee, and those of secure aggregation (``secagg.*``)."""
    run = metrics.get("privacy") or {}
    if run.get("mode") == "client":
        fields = ("epsilon", "delta", "noise_multiplier", "clipping_norm", "clipped_fraction", "epsilon_max")
        out = {k: float(run[k]) for k in fields if run.get(k) is not None}
    else:
        fields = ("epsilon", "delta", "noise_multiplier", "max_grad_norm", "clipped_fraction")
        out = {f"{c}.{k}": v["privacy"][k] for c, v in metrics["clients"].items() if "privacy" in v
               for k in fields if v["privacy"][k] is not None}
        out |= {k: run[k] for k in ("epsilon_max", "delta_max") if run.get(k) is not None}
    if metrics.get("secure_aggregation"):
        sa = metrics["secure_aggregation"]
        out |= {"secagg.rounds_aggregated": sa["rounds_aggregated"], "secagg.dropped": sum(sa["dropped"].values()),
                "secagg.clipped_coordinates": sa["clipped_coordinates"]}
    return out
