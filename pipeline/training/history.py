"""The rounds history of a training run: ``rounds.json`` and the DVC plot file, the per-round MLflow metrics (and
their back-fill after a kill), and the recorder of each finished round."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pipeline.common import atomic
from pipeline.experiments.plans import Plan
from pipeline.training.stopping import by_round, convergence, round_mean

log = logging.getLogger("fedmeet.train")
ROUND_METRIC = "bytes_sent"  # logged in every round of every run (0 without a server): the rounds a run holds

ROUND_FIELDS = (
    "train_loss",
    "ce",
    "kd",
    "kd_fraction",
    "val_loss",
    "bytes_up",
    "bytes_down",
    "weight_share",
    "epsilon",  # this field and the next: under privacy.mode example only
    "clipped_fraction",
)


def history_row(rnd: int, client: str, sampled: int, **extra) -> dict[str, Any]:
    return {"round": rnd, "client": client, "sampled": sampled, "failed": 0, **extra, "bytes_down": 0, "bytes_up": 0}


@dataclass
class RoundLog:
    """What the server saw of one round (per client rows; no client data)."""

    round: int
    seconds: float
    rows: list[dict[str, Any]]


def training_rounds(
    plan: Plan, recorder, clients: list[str], ckpt: dict | None, history: list[dict], logger, late: str | None = None
) -> Iterator[int]:
    """The rounds a run trains (the server's loop and the serverless one): after the round checkpoint ``ckpt`` (None:
    from round 1) to train.rounds, unless train.stop ends the run first (stopping.convergence's ``converged``, None
    without the rule; checked before each round, so a resumed run reads the same answer from its restored history;
    ``late``: convergence's). The caller's loop body extends ``history`` by its round's rows and checkpoints the
    round; then the round, timed with its checkpoint, goes to ``recorder``."""
    start = int(ckpt["round"]) + 1 if ckpt is not None else 1
    if ckpt is not None:
        logger.info("%s: resuming after round %d", plan.experiment, start - 1)
    recorder.started(plan, clients, start)
    for rnd in range(start, plan.train.rounds + 1):
        if convergence(history, plan.train.stop, late)["converged"]:
            logger.info("%s: the clients have converged after round %d: the run ends", plan.experiment, rnd - 1)
            return
        t0, done = time.perf_counter(), len(history)
        yield rnd
        recorder.round_done(plan, RoundLog(rnd, time.perf_counter() - t0, history[done:]), history)


def _client_fields(row: dict[str, Any], keys: tuple[str, ...] = ROUND_FIELDS) -> dict[str, Any]:
    """A client row's quantities that are set (epsilon only under example-level DP; client-level DP's is the run's)."""
    return {k: row[k] for k in keys if row.get(k) is not None and not (k == "epsilon" and "update_clipped" in row)}


def client_level_round(rows: list[dict[str, Any]]) -> dict[str, float]:
    """One round's run-level privacy fields under privacy.mode client (empty when it released nothing): the
    federation's epsilon and C, and the fraction of the aggregated updates C clipped."""
    if not (released := [r for r in rows if "update_clipped" in r]):
        return {}
    out = {
        "clipping_norm": released[0]["clipping_norm"],
        "clipped_fraction": sum(r["update_clipped"] for r in released) / len(released),
    }
    if released[0]["epsilon"] is not None:  # None: no noise, no bound
        out["epsilon"] = released[0]["epsilon"]
    return out


def round_values(rows: list[dict[str, Any]], sep: str, keys: tuple[str, ...] = ROUND_FIELDS) -> dict[str, Any]:
    """One round's values from its rows (one per client): each client's set ``keys`` as ``<client><sep><key>``, the
    run-level privacy fields, and the stop rule's :func:`round_mean` (None where it is NaN)."""
    values = {f"{row['client']}{sep}{k}": v for row in rows for k, v in _client_fields(row, keys).items()}
    mean = round_mean(rows)
    return values | client_level_round(rows) | {"val_loss_mean": None if math.isnan(mean) else mean}


def round_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """One round's MLflow metrics: :func:`round_values` (failures too) and the round's bytes each way."""
    values = round_values(rows, ".", ROUND_FIELDS + ("failed",))
    return {k: float(v) for k, v in values.items() if v is not None} | {
        ROUND_METRIC: float(sum(r.get("bytes_down", 0) for r in rows)),
        "bytes_received": float(sum(r.get("bytes_up", 0) for r in rows)),
    }


def log_missing_rounds(logger, history: list[dict[str, Any]]) -> None:
    """Log the rounds of ``history`` the MLflow run lacks: a kill between a round's checkpoint and its logging
    leaves that round to the resumed run, which does not train it again."""
    logged = {m.step for m in logger.metric_history(ROUND_METRIC)}
    rounds = by_round(history)
    for rnd in sorted(set(rounds) - logged):
        logger.log_metrics(round_metrics(rounds[rnd]), step=rnd)


def write_rounds(plan: Plan, history: list[dict[str, Any]]) -> None:
    """``models/<exp>/rounds.json`` (the history rows) and ``reports/train/<exp>/rounds.json`` (DVC plots: one row
    per round, a column per client and quantity)."""
    atomic.write_json(Path(plan.paths["out_dir"]) / "rounds.json", history, indent=1)
    wide = [{"round": rnd} | round_values(rows, "/") for rnd, rows in sorted(by_round(history).items())]
    atomic.write_json(Path(plan.paths["reports_dir"]) / "rounds.json", wide, indent=1)


class TrainRecorder:
    """Per-round bookkeeping shared by both paths: rounds files, MLflow metrics, progress on the console."""

    def __init__(self, logger=None):
        self.logger, self.round_seconds, self._bar = logger, [], None

    def started(self, plan: Plan, clients: list[str], start_round: int) -> None:
        self._bar = tqdm(
            total=plan.train.rounds, initial=start_round - 1, desc=f"{plan.experiment} rounds", unit="round"
        )
        log.info(
            "%s (%s): clients %s, starting at round %d of %d",
            plan.experiment,
            plan.method,
            clients,
            start_round,
            plan.train.rounds,
        )

    def round_done(self, plan: Plan, entry: RoundLog, history: list[dict[str, Any]]) -> None:
        self.round_seconds.append(entry.seconds)
        write_rounds(plan, history)
        if self.logger is not None:
            self.logger.log_metrics({"round_seconds": entry.seconds} | round_metrics(entry.rows), step=entry.round)
        summary = " ".join(f"{r['client']}={r['val_loss']:.3f}" for r in entry.rows if r.get("val_loss") is not None)
        self._bar.set_postfix_str(f"val {summary}")  # started() made the bar
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
