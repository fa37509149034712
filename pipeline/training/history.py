"""The rounds history of a training run: ``rounds.json`` (one row per round and client) and the DVC plot file, the
per-round MLflow metrics, and the back-fill of rounds a killed run checkpointed but did not log."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.common import atomic
from pipeline.experiments import Plan

ROUND_FIELDS = ("train_loss", "ce", "kd", "kd_fraction", "val_loss", "bytes_up", "bytes_down", "weight_share",
                "epsilon", "clipped_fraction")  # the last two under privacy.mode example only


@dataclass
class RoundLog:
    """What the server saw of one round (per client rows; no client data)."""

    round: int
    seconds: float
    rows: list[dict[str, Any]]
    aggregated: bool


def client_level_round(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The run-level privacy fields of one round under privacy.mode client, empty when it released nothing: one
    epsilon and C for the whole federation, and the fraction of the aggregated updates C clipped (the rows of the
    aggregated clients carry them; logged per run, not per client)."""
    released = [r for r in rows if "update_clipped" in r]
    if not released:
        return {}
    out = {"clipping_norm": released[0]["clipping_norm"],
           "clipped_fraction": sum(r["update_clipped"] for r in released) / len(released)}
    if released[0]["epsilon"] is not None:  # None: no noise, no bound
        out["epsilon"] = released[0]["epsilon"]
    return out


def round_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """One round's MLflow metrics from its rows (one per client)."""
    metrics: dict[str, float] = {}
    for row in rows:
        for key in ROUND_FIELDS + ("failed",):
            if row.get(key) is not None and not (key == "epsilon" and "update_clipped" in row):
                metrics[f"{row['client']}.{key}"] = float(row[key])
    metrics.update({k: float(v) for k, v in client_level_round(rows).items()})
    metrics["bytes_sent"] = float(sum(r.get("bytes_down", 0) for r in rows))
    metrics["bytes_received"] = float(sum(r.get("bytes_up", 0) for r in rows))
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    if vals:
        metrics["val_loss_mean"] = sum(vals) / len(vals)
    return metrics


def log_missing_rounds(logger, history: list[dict[str, Any]]) -> list[int]:
    """Log the rounds of ``history`` the MLflow run lacks: a kill between a round's checkpoint and its logging
    leaves that round to the resumed run, which does not train it again. Returns the rounds logged."""
    logged = {m.step for m in logger.metric_history("bytes_sent")}
    by_round: dict[int, list[dict[str, Any]]] = {}
    for row in history:
        by_round.setdefault(int(row["round"]), []).append(row)
    missing = sorted(set(by_round) - logged)
    for rnd in missing:
        logger.log_metrics(round_metrics(by_round[rnd]), step=rnd)
    return missing


def write_rounds(plan: Plan, history: list[dict[str, Any]]) -> None:
    """``models/<exp>/rounds.json`` (the history rows) and ``reports/train/<exp>/rounds.json`` (DVC plots: one row
    per round, a column per client and quantity)."""
    out_dir, reports_dir = Path(plan.paths["out_dir"]), Path(plan.paths["reports_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    reports_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_json(out_dir / "rounds.json", history, indent=1)
    wide: dict[int, dict[str, Any]] = {}
    by_round: dict[int, list[dict[str, Any]]] = {}
    for row in history:
        w = wide.setdefault(row["round"], {"round": row["round"]})
        by_round.setdefault(row["round"], []).append(row)
        for key in ROUND_FIELDS:
            if row.get(key) is not None and not (key == "epsilon" and "update_clipped" in row):
                w[f"{row['client']}/{key}"] = row[key]
    for rnd, rows in by_round.items():
        wide[rnd].update(client_level_round(rows))
    for w in wide.values():
        vals = [v for k, v in w.items() if k.endswith("/val_loss")]
        w["val_loss_mean"] = sum(vals) / len(vals) if vals else None
    atomic.write_json(reports_dir / "rounds.json", [wide[r] for r in sorted(wide)], indent=1)
