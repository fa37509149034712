"""The recorders that receive each finished round: the base :class:`Recorder` logs (an engine run without the
train stage), :class:`TrainRecorder` writes the rounds files and the per-round MLflow metrics (the train stage)."""
from __future__ import annotations

import logging
from typing import Any

from pipeline.experiments import Plan
from pipeline.training.history import RoundLog, round_metrics, write_rounds

log = logging.getLogger("fedmeet.train")
_federated_log = logging.getLogger("fedmeet.federated")  # the base Recorder's (an engine run without the stage)


class Recorder:
    """Receives each finished round (rounds.json, MLflow...). The base class only logs."""

    def started(self, plan: Plan, clients: list[str], start_round: int) -> None:
        _federated_log.info("%s: %d clients %s, rounds %d..%d", plan.experiment, len(clients), clients, start_round,
                            plan.train.rounds)

    def round_done(self, plan: Plan, entry: RoundLog, history: list[dict[str, Any]]) -> None:
        losses = ", ".join(f"{r['client']} {r.get('val_loss', float('nan')):.4f}" for r in entry.rows)
        _federated_log.info("%s round %d (%.1fs): val loss %s", plan.experiment, entry.round, entry.seconds, losses)


class TrainRecorder:
    """Per-round bookkeeping shared by both paths: rounds files, MLflow metrics, progress on the console."""

    def __init__(self, plan: Plan, logger=None):
        self.logger, self.round_seconds, self._bar = logger, [], None

    def started(self, plan: Plan, clients: list[str], start_round: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=plan.train.rounds, initial=start_round - 1, desc=f"{plan.experiment} rounds",
                         unit="round")
        log.info("%s (%s): clients %s, starting at round %d of %d", plan.experiment, plan.method, clients,
                 start_round, plan.train.rounds)

    def round_done(self, plan: Plan, entry: RoundLog, history: list[dict[str, Any]]) -> None:
        self.round_seconds.append(entry.seconds)
        write_rounds(plan, history)
        if self.logger is not None:
            self.logger.log_metrics({"round_seconds": entry.seconds} | round_metrics(entry.rows), step=entry.round)
        if self._bar is not None:
            summary = " ".join(f"{r['client']}={r['val_loss']:.3f}" for r in entry.rows
                               if r.get("val_loss") is not None)
            self._bar.set_postfix_str(f"val {summary}")
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
