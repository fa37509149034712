"""What a stop rule (``train.stop``, pipeline.training.stopping) would leave on the committed CPU-study curves:
each run's client-average validation loss (reports/cpu-study/train/<exp>/rounds.json) continued by the power law
fitted to it, the round the rule would end it at, the per-round gain there and the projected gain from there to the
ceiling. ``python -m benchmarks.stop_rule --write docs/statistics.md`` rewrites the table between the stop-rule
markers there for the rule of configs/gpu-study.yaml and the one it replaced; tests/test_stopping.py checks the
projection on a known curve.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import yaml

from pipeline.experiments.train_config import StopConfig
from pipeline.results.readers import read_rounds
from pipeline.training.stopping import mean_val_loss_by_round, projected_stop

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "reports/cpu-study/train"
BEGIN, END = "<!-- stop-rule:begin -->", "<!-- stop-rule:end -->"
REPLACED = StopConfig(enabled=True, min_rel_improvement=0.005, patience=3, max_rounds=40)  # issue 28's rule
HOLDOUT_FIT = 6  # rounds the holdout fit sees; it predicts the rest


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
