"""When a run's clients have converged, the one test of ``train.stop`` and ``train.join`` (docs/ARCHITECTURE.md):
in each of the last ``patience`` rounds the client-average validation loss improved on the best mean before it by
less than ``min_rel_improvement`` of that best. And what a run the rule ends would still gain, projected by a power
law fitted to its curve (:func:`projected_stop`; the numbers for the committed curves: docs/statistics.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def relative_improvements(means: Sequence[float]) -> list[float]:
    """For each round after the first, how much its mean improved on the best mean before it, relative to that
    best (negative when it got worse)."""
    return [(min(means[:i]) - means[i]) / abs(min(means[:i])) if min(means[:i]) else 0.0 for i in range(1, len(means))]


def plateaued(means: Sequence[float], min_rel_improvement: float, patience: int) -> bool:
    """Whether each of the last ``patience`` means improved on the best mean before it by less than
    ``min_rel_improvement`` (relative); False while there are not ``patience`` rounds after a first one."""
    if len(means) < patience + 1:
        return False  # a round's improvement needs an earlier round to compare with
    return all(imp < min_rel_improvement for imp in relative_improvements(means)[-patience:])


def mean_val_loss_by_round(
    history: list[dict[str, Any]], since: int = 1, before: int | None = None, exclude: str | None = None
) -> list[tuple[int, float]]:
    """(round, client-average validation loss) for the rounds ``since`` <= round < ``before`` that have one, in
    round order; the rows of client ``exclude`` are left out."""
    by_round: dict[int, list[float]] = {}
    for row in history:
        rnd = int(row["round"])
        if (
            rnd >= since
            and (before is None or rnd < before)
            and row["client"] != exclude
            and row.get("val_loss") is not None
        ):
            by_round.setdefault(rnd, []).append(float(row["val_loss"]))
    return [(r, float(np.mean(v))) for r, v in sorted(by_round.items())]  # numpy's sum order, as join had


def series_start(history: list[dict[str, Any]], late: str | None) -> int:
    """The first round of the run's stop series: with a late client (post-addition), the round it joined, since
    the client average changes its meaning then (before it joins: no round, the run cannot stop yet)."""
    if late is None:
        return 1
    joined = [int(r["round"]) for r in history if r["client"] == late]
    return min(joined) if joined else 10**9


def should_stop(history: list[dict[str, Any]], stop, late: str | None = None) -> bool:
    """Whether a run with ``train.stop`` enabled ends after the rounds of ``history`` (checked before each round,
    so a resumed run reads the same answer from its restored history)."""
    return stop.enabled and convergence(history, stop, late)["converged"]


def convergence(history: list[dict[str, Any]], stop, late: str | None = None) -> dict[str, Any]:
    """What a finished run records: the round it stopped at, its best round (lowest client-average validation loss,
    the first of equals) and whether it converged: the rule of ``stop`` holds at its last round. A run that reached
    its round ceiling before the rule held is not converged. Under a small tolerance the last round is often the best
    by a hair; that is still converged (the rule bounds what each further round gains, docs/statistics.md)."""
    stopped = max((int(r["round"]) for r in history), default=0)
    series = mean_val_loss_by_round(history, since=series_start(history, late))
    best = min(series, key=lambda rm: rm[1])[0] if series else None
    converged = plateaued([m for _, m in series], stop.min_rel_improvement, stop.patience)
    return {"stopped_round": stopped, "best_round": best, "converged": bool(converged)}


# --- what the rule leaves on the table: a power law fitted to a run's curve (docs/statistics.md, "Stop rule") ---


def power_law(rounds: np.ndarray, a: float, b: float, c: float) -> np.ndarray:
    """Validation loss a + b * round^-c: a the floor it tends to, c how fast it gets there."""
    return a + b * np.asarray(rounds, dtype=float) ** -c


def fit_power_law(rounds: Sequence[int], losses: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares (a, b, c) of :func:`power_law` through a run's client-average validation losses (a >= 0,
    b >= 0, 0.01 <= c <= 5)."""
    from scipy.optimize import curve_fit

    t, y = np.asarray(rounds, dtype=float), np.asarray(losses, dtype=float)
    start = (max(float(y[-1]) - 0.5, 0.0), float(y[0] - y[-1]) + 0.5, 0.5)
    params, _ = curve_fit(power_law, t, y, p0=start, bounds=([0.0, 0.0, 0.01], [np.inf, np.inf, 5.0]), maxfev=20000)
    return tuple(float(x) for x in params)


def projected_stop(
    rounds: Sequence[int], losses: Sequence[float], stop, fit_rounds: int | None = None
) -> dict[str, float | int | None]:
    """Where the rule of ``stop`` would end a run whose curve goes on as the power law fitted to its first
    ``fit_rounds`` rounds (all by default), and what it would leave: the fit's error on the rounds it did not see
    (``holdout_error``, max abs, nats; None when it saw all), the round the rule holds (None: not before
    ``stop.max_rounds``, the ceiling), the projected fall from round 1 to there (``gain_before``), the per-round
    gain there and the projected gain from there to the ceiling (``remaining_gain``; 0 when the ceiling comes
    first), all in nats."""
    seen = len(rounds) if fit_rounds is None else fit_rounds
    a, b, c = fit_power_law(rounds[:seen], losses[:seen])
    holdout = (
        float(np.abs(power_law(np.asarray(rounds[seen:]), a, b, c) - np.asarray(losses[seen:])).max())
        if seen < len(rounds)
        else None
    )
    curve = power_law(np.arange(1, stop.max_rounds + 1), a, b, c)
    at = next(
        (
            r
            for r in range(1, stop.max_rounds + 1)
            if plateaued(list(curve[:r]), stop.min_rel_improvement, stop.patience)
        ),
        None,
    )
    end = at or stop.max_rounds
    return {
        "a": a,
        "b": b,
        "c": c,
        "holdout_error": holdout,
        "stop_round": at,
        "gain_before": float(curve[0] - curve[end - 1]),
        "gain_per_round": float(curve[end - 2] - curve[end - 1]),
        "remaining_gain": float(curve[end - 1] - curve[-1]),
    }
