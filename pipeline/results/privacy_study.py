"""The privacy-utility study (study `privacy`): per configuration, the client average of average ROUGE over seeds
against the epsilon the runs spent (largest over clients, mean over seeds), no privacy drawn at epsilon = inf."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import pandas as pd

from pipeline.common import atomic
from pipeline.experiments import Experiment
from pipeline.results.readers import read_json

STUDY = "privacy"
COLUMNS = ["method", "label", "dp", "epsilon", "delta", "target_epsilon", "noise_multiplier", "avg_rouge_mean",
           "avg_rouge_std", "n_seeds", "backbone"]


def spent_epsilon(train_metrics: dict) -> tuple[float, float | None, float | None, float | None]:
    """(epsilon, target, noise multiplier, delta) of one run: the largest epsilon over its clients (inf without
    DP) and the largest delta (None without DP)."""
    privacy = train_metrics.get("privacy") or {}
    clients = [c["privacy"] for c in (train_metrics.get("clients") or {}).values() if "privacy" in c]
    if not privacy or not clients:
        return math.inf, None, None, None
    eps = [c["epsilon"] for c in clients]
    return ((math.inf if None in eps else max(eps)), privacy.get("target_epsilon"),
            max(c["noise_multiplier"] for c in clients),
            max((c["delta"] for c in clients if c.get("delta") is not None), default=None))


def privacy_points(planned: Iterable[Experiment], labels: dict[str, str], scores: pd.DataFrame,
                   train_reports: Path) -> pd.DataFrame:
    """One row per configuration of the study: its client-average ROUGE over seeds and the epsilon it spent."""
    members = [p for p in planned if p.study == STUDY]
    rows = []
    for label in dict.fromkeys(labels[p.name] for p in members):
        runs = [p for p in members if labels[p.name] == label]
        per_seed, spent = [], []  # the client average of each seed; spent_epsilon of each seed
        for p in runs:
            mine = scores[scores["experiment"] == p.name]
            metrics_path = train_reports / p.name / "metrics.json"
            if not mine.empty and metrics_path.is_file():
                per_seed.append(float(mine["avg_rouge"].mean()))
                spent.append(spent_epsilon(read_json(metrics_path, "train metrics")))
        if not per_seed:
            continue
        eps, targets, sigmas, deltas = zip(*spent)
        series, names = pd.Series(per_seed), [p.name for p in runs]
        rows.append({"method": runs[0].method, "label": label, "dp": runs[0].dp,
                     "epsilon": float(pd.Series(eps).mean()) if all(math.isfinite(e) for e in eps) else math.inf,
                     "delta": max((d for d in deltas if d is not None), default=None),
                     "target_epsilon": targets[0], "noise_multiplier": sigmas[0],
                     "avg_rouge_mean": float(series.mean()), "n_seeds": len(series),
                     "avg_rouge_std": float(series.std(ddof=1)) if len(series) > 1 else math.nan,
                     "backbone": str(scores.loc[scores["experiment"].isin(names), "backbone"].iloc[0])})
    return pd.DataFrame(rows, columns=COLUMNS)


def privacy_figure(points: pd.DataFrame, figure: Path, data: Path) -> Path:
    """ROUGE against the epsilon spent, one line per method (log x; no privacy drawn at the right as inf)."""
    from pipeline.results.figures import plt, save

    atomic.to_csv(points, data, index=False)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    finite = points.loc[points["epsilon"].apply(math.isfinite), "epsilon"]
    right = (finite.max() * 4) if not finite.empty else 10.0  # where "no privacy" (epsilon = inf) is drawn
    for method, grp in points.groupby("method", sort=False):
        grp = grp.assign(x=[e if math.isfinite(e) else right for e in grp["epsilon"]]).sort_values("x")
        err = grp["avg_rouge_std"].fillna(0.0)
        ax.errorbar(grp["x"], grp["avg_rouge_mean"], yerr=err, marker="o", capsize=3, label=method)
        for r in grp.itertuples():
            ax.annotate(f"n={r.n_seeds}", (r.x, r.avg_rouge_mean), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
    ax.set_xscale("log")
    ticks = [t for t in (0.1, 0.3, 1, 3, 10, 30, 100) if finite.empty or finite.min() / 1.5 <= t <= finite.max() * 1.5]
    ax.set_xticks(ticks + [right])
    ax.set_xticklabels([f"{t:g}" for t in ticks] + ["∞ (none)"])
    ax.minorticks_off()
    backbones = ", ".join(sorted(set(points["backbone"])))
    seeds = "/".join(str(n) for n in sorted(set(points["n_seeds"])))
    deltas = points["delta"].dropna()
    held = f"delta <= {deltas.max():.3g}" if not deltas.empty else "no DP run"
    ax.set_xlabel(f"epsilon spent (largest over clients; {held})")
    ax.set_ylabel("average ROUGE, client average")
    ax.set_title(f"Privacy vs utility ({backbones}; n={seeds} seeds; bars: std over seeds)", fontsize=9)
    ax.legend(fontsize=8)
    return save(fig, figure)
