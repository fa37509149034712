"""The numbers a run is summed up by: ``reports/summary.json`` (every study's average ROUGE per configuration and
client) and ``reports/metrics.json``, the one DVC metrics file (the main study's headline ROUGE with its interval,
and the KD usage per client)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from pipeline.results import comparisons
from pipeline.experiments import Experiment
from pipeline.results.scoring import TABLE_ROUGE_L
from pipeline.results.stats import BootstrapConfig, mean_interval


def summary_metrics(agg: pd.DataFrame, planned: Sequence[Experiment], missing_eval: list[str]) -> dict[str, Any]:
    """reports/summary.json (a plain output; the DVC metric is reports/metrics.json): average ROUGE per study,
    configuration and client, mean over clients."""
    out: dict[str, Any] = {"experiments_planned": len(planned), "experiments_evaluated": len(planned) - len(missing_eval),
                           "experiments_missing": len(missing_eval)}
    for (study, label), grp in agg.groupby(["study", "label"], sort=True):
        entry = {client: round(float(v), 4) for client, v in zip(grp["client"], grp["avg_rouge_mean"])}
        entry["mean_over_clients"] = round(float(grp["avg_rouge_mean"].mean()), 4)
        entry["n_seeds"] = int(grp["n_seeds"].min())
        out.setdefault(study, {})[label.replace(" ", "_")] = entry
    return out


# reports/metrics.json, the one DVC metrics file: what `dvc exp show` / `dvc metrics diff` put side by side across
# DVC experiments. Only the main study's results (the study `-S tau=...` ablates): every other report file is a
# plain output, and no time or memory figure is a metric (they differ between runs of the same experiment).
HEADLINE_STUDY = "main"
HEADLINE_ROUGE = {"rouge1": "rouge1", "rouge2": "rouge2", "rougeL": TABLE_ROUGE_L, "avg_rouge": "avg_rouge"}


def average_interval(config: comparisons.Config, eval_dir: Path, cfg: BootstrapConfig) -> tuple[float, float] | None:
    """Interval of a configuration's client-average avg ROUGE over its seeds (pipeline.results.stats.mean_interval) on
    the test examples every seed has. None without any per-example scores."""
    frames = [f for _, name in config.runs if (f := comparisons.per_example(eval_dir, name)) is not None]
    shared = comparisons.shared_ids(frames)
    if not shared:
        return None
    per_client = [comparisons.stacked(frames, client, ids, "avg_rouge") for client, ids in shared.items()]
    r = mean_interval(per_client, cfg)
    return r.low, r.high


def headline_metrics(agg: pd.DataFrame, intervals: dict[str, tuple[float, float] | None],
                     kd_analysis: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers: per method (per configuration where a method has several) of the main study, its client-average ROUGE-1/2/L and average ROUGE
    (means over seeds) with the average's interval (``intervals``, by label), and each client's average ROUGE; and
    the KD usage ratio per client of the main SelectKD run (``kd_analysis``: reports/analysis/kd_analysis.json)."""
    out: dict[str, Any] = {}
    main = agg[agg["study"] == HEADLINE_STUDY] if not agg.empty else agg
    # Keyed by method, so an ablation (`-S tau=4` relabels "fedselectkd tau=5") stays in the same DVC metric column;
    # by label only where the study holds several configurations of one method.
    methods = main.groupby("label")["method"].first() if "method" in main else pd.Series(dtype=object)
    repeated = set(methods[methods.duplicated(keep=False)])
    for label, grp in main.groupby("label", sort=True):
        method = methods.get(label)
        key = str(method) if method is not None and method not in repeated else str(label).replace(" ", "_")
        entry: dict[str, Any] = {key: round(float(grp[f"{col}_mean"].mean()), 4) for key, col in HEADLINE_ROUGE.items()}
        interval = intervals.get(label)
        if interval is not None:
            entry["avg_rouge_low"], entry["avg_rouge_high"] = (round(float(v), 4) for v in interval)
        entry["clients"] = {str(c): round(float(v), 4) for c, v in zip(grp["client"], grp["avg_rouge_mean"])}
        out.setdefault(HEADLINE_STUDY, {})[key] = entry
    usage = {str(c): round(float(v["kd_usage_ratio"]), 4) for c, v in sorted(kd_analysis.get("clients", {}).items())
             if isinstance(v, dict) and v.get("kd_usage_ratio") is not None}
    if usage:
        out["kd_usage"] = {**usage, "mean": round(sum(usage.values()) / len(usage), 4)}
    return out
