"""What a stop rule (``train.stop``, pipeline.training.stopping) would leave on the committed CPU-study curves:
each run's client-average validation loss (reports/cpu-study/train/<exp>/rounds.json) continued by the power law
fitted to it, the round the rule would end it at, the per-round gain there and the projected gain from there to the
ceiling. ``python -m benchmarks.stop_rule --write docs/statistics.md`` rewrites the table between the stop-rule
markers there for the rule of configs/gpu-study.yaml and the one it replaced; tests/test_stopping.py checks the
projection on a known curve.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import curve_fit

from pipeline.experiments.train_config import StopConfig
from pipeline.results.readers import read_rounds
from pipeline.training.stopping import mean_val_loss_by_round, plateaued

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "reports/cpu-study/train"
BEGIN, END = "<!-- stop-rule:begin -->", "<!-- stop-rule:end -->"
REPLACED = StopConfig(enabled=True, min_rel_improvement=0.005, patience=3, max_rounds=40)  # issue 28's rule
HOLDOUT_FIT = 6  # rounds the holdout fit sees; it predicts the rest


# --- what the rule leaves on the table: a power law fitted to a run's curve (docs/statistics.md, "Stop rule") ---


def power_law(rounds: np.ndarray, a: float, b: float, c: float) -> np.ndarray:
    """Validation loss a + b * round^-c: a the floor it tends to, c how fast it gets there."""
    return a + b * np.asarray(rounds, dtype=float) ** -c


def fit_power_law(rounds: Sequence[int], losses: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares (a, b, c) of :func:`power_law` through a run's client-average validation losses (a >= 0,
    b >= 0, 0.01 <= c <= 5); a round without a client average (NaN: training.stopping) is left out."""
    t, y = np.asarray(rounds, dtype=float), np.asarray(losses, dtype=float)
    t, y = t[np.isfinite(y)], y[np.isfinite(y)]
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
        float(np.nanmax(np.abs(power_law(np.asarray(rounds[seen:]), a, b, c) - np.asarray(losses[seen:]))))
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


def curves(train_dir: Path = TRAIN) -> dict[str, tuple[list[int], list[float]]]:
    """Per run, its rounds and client-average validation losses."""
    out = {}
    for path in sorted(train_dir.glob("*/rounds.json")):
        series = mean_val_loss_by_round(read_rounds(path).to_dict("records"))
        out[path.parent.name] = ([r for r, _ in series], [m for _, m in series])
    return out


def _span(values: list[float], fmt: str) -> str:
    return f"{fmt.format(np.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def row(stop: StopConfig, runs: dict[str, tuple[list[int], list[float]]]) -> str:
    """One markdown row: the rule, how many runs it ends before the ceiling, and median (range) over runs of the
    round, the per-round gain there and the projected gain left to the ceiling."""
    found = [projected_stop(r, loss, stop) for r, loss in runs.values()]
    stopped = [f for f in found if f["stop_round"] is not None]
    rule = f"< {stop.min_rel_improvement * 100:g} % for {stop.patience} rounds, ceiling {stop.max_rounds}"
    if not stopped:
        return f"| {rule} | 0 of {len(found)} | – | – | – | – |"
    return (
        f"| {rule} | {len(stopped)} of {len(found)} | {_span([f['stop_round'] for f in stopped], '{:.0f}')} | "
        f"{_span([f['gain_per_round'] for f in stopped], '{:.4f}')} | "
        f"{_span([f['remaining_gain'] for f in stopped], '{:.3f}')} | "
        f"{_span([f['remaining_gain'] / f['gain_before'] for f in stopped], '{:.0%}')} |"
    )


def table(stop: StopConfig, runs: dict[str, tuple[list[int], list[float]]] | None = None) -> str:
    runs = curves() if runs is None else runs
    holdout = [projected_stop(r, loss, stop, fit_rounds=HOLDOUT_FIT)["holdout_error"] for r, loss in runs.values()]
    return "\n".join(
        [
            "| rule (best client-average validation loss improved by ...) | runs it ends before the ceiling | "
            "round it ends them | gain per round there (nats) | projected gain left to the ceiling (nats) | "
            "left to the ceiling / fallen from round 1 |",
            "|---|---|---|---|---|---|",
            row(REPLACED, runs),
            row(stop, runs),
            "",
            f"Power law a + b t^-c per run ({len(runs)} runs of {max(len(r) for r, _ in runs.values())} rounds); "
            f"fitted to rounds 1-{HOLDOUT_FIT} it predicts the later rounds within {max(holdout):.3f} nats "
            f"(median {np.median(holdout):.3f}).",
        ]
    )


def gpu_study_stop() -> StopConfig:
    """The stop rule configs/gpu-study.yaml sets."""
    train = yaml.safe_load((ROOT / "configs/gpu-study.yaml").read_text())["train"]
    return StopConfig(**train["stop"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stop_rule", description=__doc__.split("\n")[0])
    parser.add_argument("--write", type=Path, help="rewrite the stop-rule block of this markdown file")
    args = parser.parse_args(argv)
    block = table(gpu_study_stop())
    if args.write:
        text = args.write.read_text(encoding="utf-8")
        start, end = text.find(BEGIN), text.find(END)
        if start < 0 or end < start:
            raise SystemExit(f"{args.write}: no {BEGIN} ... {END} block")
        args.write.write_text(text[: start + len(BEGIN)] + "\n" + block + "\n" + text[end:], encoding="utf-8")
    print(block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
