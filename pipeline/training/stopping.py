"""When a run's clients have converged, the one test of ``train.stop`` and ``train.join`` (docs/ARCHITECTURE.md):
in each of the last ``patience`` rounds the client-average validation loss improved on the best mean before it by
less than ``min_rel_improvement`` of that best. What a run the rule ends would still gain, projected by a power law
fitted to its curve, is benchmarks/stop_rule.py's (a study-planning measure, not part of a run)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np


def relative_improvements(means: Sequence[float]) -> list[float]:
    """For each round after the first, how much its mean improved on the best mean before it, relative to that
    best (negative when it got worse; fmin passes over a NaN mean, never a best: NaN while no number came before)."""
    return [float((b - m) / abs(b)) if b else 0.0 for b, m in zip(np.fmin.accumulate(means)[:-1], means[1:])]


def plateaued(means: Sequence[float], min_rel_improvement: float, patience: int) -> bool:
    """Whether each of the last ``patience`` means improved on the best mean before it by less than
    ``min_rel_improvement`` (relative); False while there are not ``patience`` rounds after a first one."""
    if len(means) < patience + 1:
        return False  # a round's improvement needs an earlier round to compare with
    return all(imp < min_rel_improvement for imp in relative_improvements(means)[-patience:])


def round_mean(rows: list[dict[str, Any]]) -> float:
    """One round's client-average validation loss from its rows (a client's last set value counts): NaN, never best,
    where a client with a row (asked to evaluate) has none, since the others' mean would read as a gain or a plateau.
    The one definition: the stop rule, rounds.json's ``val_loss_mean`` (MLflow's too) and the learning curves."""
    losses: dict[str, float] = {}
    for row in rows:
        v = row.get("val_loss")
        losses[row["client"]] = float(v) if v is not None else losses.get(row["client"], np.nan)
    return float(np.mean(list(losses.values())))  # numpy's sum order


def by_round(history: Iterable[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Each round's rows, in the order of ``history``."""
    rounds: dict[int, list[dict[str, Any]]] = {}
    for row in history:
        rounds.setdefault(int(row["round"]), []).append(row)
    return rounds


def mean_val_loss_by_round(
    history: list[dict[str, Any]], since: int = 1, before: int | None = None, exclude: str | None = None
) -> list[tuple[int, float]]:
    """(round, :func:`round_mean`) for the rounds ``since`` <= round < ``before``, without the rows of ``exclude``."""
    rounds = sorted(by_round(row for row in history if row["client"] != exclude).items())
    return [(r, round_mean(rows)) for r, rows in rounds if since <= r and (before is None or r < before)]


def convergence(history: list[dict[str, Any]], stop, late: str | None = None) -> dict[str, Any]:
    """What a finished run records: the round it stopped at, its best round (lowest client-average validation loss,
    the first of equals) and whether it converged: the rule of ``stop`` holds at its last round (None without the
    rule: a fixed budget's runs are judged by each client's rounds, docs/statistics.md "Round budget"). A run that
    reached its round ceiling before the rule held is not converged. Under a small tolerance the last round is often
    the best by a hair; that is still converged (the rule bounds what each further round gains)."""
    stopped = max((int(r["round"]) for r in history), default=0)
    # The stop series starts at round 1, or with a late client (post-addition) at the round it joined, since the
    # client average changes its meaning then (before it joins: no round, the run cannot stop yet).
    start = 1 if late is None else min((int(r["round"]) for r in history if r["client"] == late), default=10**9)
    series = mean_val_loss_by_round(history, since=start)
    best = min(((m, r) for r, m in series if m == m), default=(None, None))[1]  # m != m: NaN, never best
    converged = plateaued([m for _, m in series], stop.min_rel_improvement, stop.patience) if stop.enabled else None
    return {"stopped_round": stopped, "best_round": best, "converged": converged}
