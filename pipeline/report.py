"""Stage `report`: tables, figures and the index of everything the pipeline produced (METHOD.md section 7).

    python -m pipeline.report                            # the DVC stage
    python -m pipeline.report human --make-sheets DIR    # blind pairwise human-evaluation sheets
    python -m pipeline.report human --sheets DIR         # filled sheets -> win/tie/loss + bar chart

Reads every planned experiment (params.yaml `experiments`) with its evaluation (``reports/eval/<exp>/metrics.json``),
plan (``models/plans/<exp>.json``: tau) and training rounds (``reports/train/<exp>/rounds.json``), averages each
configuration over its seeds (mean and sample std) and reports missing seeds next to the numbers. Writes
``reports/tables/`` (Table III layout per backbone beside the published numbers, one table per study, case study,
stage times), ``reports/figures/*.png`` with their data in ``reports/plots/`` (DVC plots), ``reports/summary.json``
(every study's averages), ``reports/metrics.json`` (the headline numbers, the only DVC metrics file),
human-evaluation sheets and ``reports/README.md`` (index; lists what is missing and why).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from pipeline.common import atomic

from pipeline.results import comparisons

from pipeline.results import published
from pipeline.common.config import from_dict, load_params
from pipeline.results.human_eval import Prediction, make_sheets, plot_results, score_sheets
from pipeline.common.schema import DataError
from pipeline.results.scoring import TABLE_ROUGE_L
from pipeline.results.stats import BootstrapConfig, mean_interval

# Our columns in the paper's order, R-L (R-L = rougeLsum, see pipeline.results.scoring) and average ROUGE.
METRICS: tuple[str, ...] = ("rouge1", "rouge2", TABLE_ROUGE_L, "avg_rouge")
METRIC_LABELS = {"rouge1": "R-1", "rouge2": "R-2", TABLE_ROUGE_L: "R-L", "avg_rouge": "avg"}
GROUP_COLS = ("study", "label", "method", "scheme", "tau", "variant")
QMSUM = published.QMSUM_CLIENTS


@dataclass
class ReportConfig:
    expected_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    case_study_seed: int = 0
    human_eval_per_domain: int = published.HUMAN_EVAL_MEETINGS_PER_DOMAIN
    human_eval_seed: int = 0
    human_eval_target: str = "fedselectkd"
    baselines: list[str] = field(default_factory=lambda: ["single", "fedavg", "fedkd"])


@dataclass
class Paths:
    """Where the report reads and writes (relative to the project root; tests point them at a tmp dir)."""

    root: Path = Path(".")

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    @property
    def eval_dir(self) -> Path:
        return self.root / "reports/eval"

    @property
    def plans_dir(self) -> Path:
        return self.root / "models/plans"

    @property
    def train_reports(self) -> Path:
        return self.root / "reports/train"

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def examples(self) -> Path:
        return self.root / "data/processed/examples.parquet"

    @property
    def timing_dir(self) -> Path:
        return self.root / "reports/timing"

    @property
    def out(self) -> Path:
        return self.root / "reports"

    @property
    def kd_analysis(self) -> Path:
        return self.out / "analysis/kd_analysis.json"

    @property
    def tables(self) -> Path:
        return self.out / "tables"

    @property
    def figures(self) -> Path:
        return self.out / "figures"

    @property
    def plots(self) -> Path:
        return self.out / "plots"

    @property
    def human_eval(self) -> Path:
        return self.out / "human_eval"


# ---------------------------------------------------------------------------------------------------------------
# Collecting results


def scheme_of(partition: str) -> str:
    """'<scheme>/seed<k>' -> '<scheme>'."""
    return re.sub(r"/seed\d+$", "", str(partition))


@dataclass
class Planned:
    name: str
    study: str
    method: str
    scheme: str
    seed: int
    tau: float | None
    variant: str  # train overrides of the entry, e.g. "fraction_train=0.67" ("" when none)


def planned_experiments(params: dict[str, Any], plans_dir: Path | None = None) -> list[Planned]:
    """The experiments params.yaml plans; tau from the plan file when the stage wrote one (resolved default)."""
    out = []
    for name, raw in (params.get("experiments") or {}).items():
        if not isinstance(raw, dict) or "method" not in raw or "partition" not in raw:
            raise DataError(f"params.yaml experiments.{name}: needs at least 'method' and 'partition'")
        tau = raw.get("tau")
        plan_file = plans_dir / f"{name}.json" if plans_dir else None
        if plan_file is not None and plan_file.is_file():
            tau = json.loads(plan_file.read_text()).get("tau", tau)
        extra = {k: v for k, v in raw.items() if k not in ("method", "partition", "seed", "study", "tau")}
        variant = ",".join(f"{k}={extra[k]}" for k in sorted(extra))
        seed = raw.get("seed")
        if seed is None:
            m = re.search(r"/seed(\d+)$", str(raw["partition"]))
            seed = int(m.group(1)) if m else 0
        out.append(Planned(name, str(raw.get("study", "main")), str(raw["method"]), scheme_of(raw["partition"]),
                           int(seed), None if tau is None else float(tau), variant))
    return out


def with_labels(planned: list[Planned]) -> dict[str, str]:
    """A display label per experiment: the method, plus whatever else varies within its study (tau, overrides,
    partition scheme), so one study's configurations are told apart without hard-coding study layouts."""
    by_study: dict[str, list[Planned]] = defaultdict(list)
    for p in planned:
        by_study[p.study].append(p)
    labels = {}
    for members in by_study.values():
        varying = [attr for attr in ("scheme", "tau", "variant") if len({getattr(p, attr) for p in members}) > 1]
        for p in members:
            parts = [p.method]
            for attr in varying:
                value = getattr(p, attr)
                if value not in (None, ""):
                    parts.append(value if attr == "variant" else f"{attr}={value:g}" if attr == "tau" else value)
            labels[p.name] = " ".join(str(x) for x in parts)
    return labels


def read_eval_metrics(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data.get("clients"), dict):
        raise DataError(f"{path}: no per-client scores ('clients')")
    for client, scores in data["clients"].items():
        missing = [m for m in METRICS if m not in scores]
        if missing:
            raise DataError(f"{path}: client {client!r} lacks {missing}")
    return data


def collect_scores(planned: list[Planned], eval_dir: Path) -> tuple[pd.DataFrame, list[str]]:
    """One row per (evaluated experiment, client); and the names of planned experiments without an evaluation."""
    labels = with_labels(planned)
    rows, missing = [], []
    for p in planned:
        path = eval_dir / p.name / "metrics.json"
        if not path.is_file():
            missing.append(p.name)
            continue
        metrics = read_eval_metrics(path)
        for client, scores in metrics["clients"].items():
            rows.append({"experiment": p.name, "study": p.study, "label": labels[p.name], "method": p.method,
                         "scheme": p.scheme, "tau": p.tau, "variant": p.variant, "seed": p.seed,
                         "backbone": metrics.get("backbone") or "unknown", "client": client,
                         **{m: float(scores[m]) for m in METRICS}, "n_examples": int(scores.get("n", 0))})
    columns = ["experiment", *GROUP_COLS, "seed", "backbone", "client", *METRICS, "n_examples"]
    return pd.DataFrame(rows, columns=columns), missing


def aggregate(scores: pd.DataFrame, planned: list[Planned], expected_seeds: Iterable[int]) -> pd.DataFrame:
    """Mean and sample std over seeds per (configuration, backbone, client), with the seeds present and missing.

    A configuration's expected seeds are ``expected_seeds`` plus any seed params.yaml plans for it; a seed is
    missing for a client when no evaluated experiment of that configuration has the client.
    """
    expected = set(int(s) for s in expected_seeds)
    labels = with_labels(planned)
    planned_seeds: dict[tuple, set[int]] = defaultdict(set)
    for p in planned:
        planned_seeds[(p.study, labels[p.name], p.method, p.scheme, p.tau, p.variant)].add(p.seed)
    keys = [*GROUP_COLS, "backbone", "client"]
    out_rows = []
    if scores.empty:
        return pd.DataFrame(columns=[*keys, *[f"{m}_mean" for m in METRICS], *[f"{m}_std" for m in METRICS],
                                     "n_seeds", "seeds", "missing_seeds"])
    frame = scores.copy()
    frame["tau"] = frame["tau"].astype(object).where(frame["tau"].notna(), None)
    for key, grp in frame.groupby(keys, dropna=False, sort=False):
        rec = dict(zip(keys, key))
        config = tuple(rec[c] for c in GROUP_COLS)
        config = tuple(None if (isinstance(v, float) and math.isnan(v)) else v for v in config)
        rec["tau"] = config[4]
        seeds = sorted(int(s) for s in grp["seed"])
        want = expected | planned_seeds.get(config, set())
        for m in METRICS:
            rec[f"{m}_mean"] = float(grp[m].mean())
            rec[f"{m}_std"] = float(grp[m].std(ddof=1)) if len(grp) > 1 else math.nan
        rec["n_seeds"] = len(seeds)
        rec["seeds"] = ",".join(map(str, seeds))
        rec["missing_seeds"] = ",".join(map(str, sorted(want - set(seeds))))
        out_rows.append(rec)
    return pd.DataFrame(out_rows)


def fmt(mean: float, std: float, n: int | None = None, missing: str = "") -> str:
    """'27.09 ± 0.31' (sample std over n >= 2 seeds), '27.09 (n=1)': one seed has no spread, so none is shown
    (never '± 0.00'); missing seeds appended as '[missing seed 1,2]'."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "missing"
    one_seed = n is not None and int(n) == 1
    text = f"{mean:.2f}"
    if one_seed:
        text += " (n=1)"
    elif std is not None and not math.isnan(std):
        text += f" ± {std:.2f}"
    if missing:
        text += f" [missing seed {missing}]"
    return text


# ---------------------------------------------------------------------------------------------------------------
# Tables


def backbone_slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name.rsplit("/", 1)[-1]).strip("-").lower() or "unknown"


def main_table(agg: pd.DataFrame, backbone: str, planned: list[Planned] | None = None,
               expected_seeds: Iterable[int] = ()) -> pd.DataFrame:
    """Table III long form: method x client x metric, ours (mean/std/seeds) beside the paper's and the difference.

    A planned main-study configuration without any evaluation still gets its rows (ours empty, every seed
    missing), so the table never hides a method silently."""
    paper = published.MAIN_TABLE.get(published.backbone_key(backbone) or "", {})
    sub = agg[(agg["study"] == "main") & (agg["backbone"] == backbone)]
    rows = []
    labels = with_labels(planned or [])
    present = set(sub["label"])
    absent: dict[str, tuple[str, set[int]]] = {}
    for p in planned or []:
        if p.study == "main" and labels[p.name] not in present:
            method, seeds = absent.setdefault(labels[p.name], (p.method, set()))
            seeds.add(p.seed)
    for label, (method, seeds) in absent.items():
        for client in QMSUM:
            pub = paper.get(client, {}).get(method)
            for metric in ("rouge1", "rouge2", TABLE_ROUGE_L):
                rows.append({"backbone": backbone, "method": method, "label": label,
                             "paper_name": published.PAPER_METHOD_NAMES.get(method, method), "client": client,
                             "metric": METRIC_LABELS[metric], "ours_mean": math.nan, "ours_std": math.nan,
                             "n_seeds": 0, "seeds": "",
                             "missing_seeds": ",".join(map(str, sorted(seeds | set(expected_seeds)))),
                             "paper": getattr(pub, "rougeL" if metric == TABLE_ROUGE_L else metric) if pub else None,
                             "diff": None})
    methods = [m for m in published.METHOD_ORDER if m in set(sub["method"])] + sorted(
        set(sub["method"]) - set(published.METHOD_ORDER))
    for method in methods:
        msub = sub[sub["method"] == method]
        for label in sorted(set(msub["label"])):
            lsub = msub[msub["label"] == label]
            clients = [c for c in QMSUM if c in set(lsub["client"])] + sorted(set(lsub["client"]) - set(QMSUM))
            for client in clients:
                r = lsub[lsub["client"] == client].iloc[0]
                pub = paper.get(client, {}).get(method)
                for metric in ("rouge1", "rouge2", TABLE_ROUGE_L):
                    p = getattr(pub, "rougeL" if metric == TABLE_ROUGE_L else metric) if pub else None
                    rows.append({"backbone": backbone, "method": method, "label": label,
                                 "paper_name": published.PAPER_METHOD_NAMES.get(method, method), "client": client,
                                 "metric": METRIC_LABELS[metric], "ours_mean": r[f"{metric}_mean"],
                                 "ours_std": r[f"{metric}_std"], "n_seeds": r["n_seeds"], "seeds": r["seeds"],
                                 "missing_seeds": r["missing_seeds"], "paper": p,
                                 "diff": None if p is None else r[f"{metric}_mean"] - p})
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    order = {m: i for i, m in enumerate(published.METHOD_ORDER)}
    table["_order"] = [order.get(m, len(order)) for m in table["method"]]
    return table.sort_values(["_order", "label"], kind="stable").drop(columns="_order").reset_index(drop=True)


def main_table_markdown(table: pd.DataFrame, backbone: str, compared: pd.DataFrame | None = None,
                        bootstrap: BootstrapConfig | None = None) -> str:
    """Rows: method (ours / paper / difference); columns: client x R-1, R-2, R-L (the paper's Table III)."""
    key = published.backbone_key(backbone)
    clients = [c for c in QMSUM if c in set(table["client"])] + sorted(set(table["client"]) - set(QMSUM))
    metrics = ["R-1", "R-2", "R-L"]
    header = ["Method", "", *[f"{c} {m}" for c in clients for m in metrics], "seeds"]
    lines = [f"# Main results, backbone `{backbone}`", "",
             f"ROUGE F1 x 100, mean ± sample std over seeds ((n=1): one seed, no spread); R-L = rouge-score "
             f"`{TABLE_ROUGE_L}` "
             "(summary-level, sentence-split, Porter stemming: ROUGE-1.5.5 as the QMSum authors ran it). "
             + (f"Paper: Feng et al. Table III, {key}." if key else
                "The paper reports no numbers for this backbone (BART-large, BART-base and LED-large only), "
                "so only ours are shown."), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label in dict.fromkeys(table["label"]):
        t = table[table["label"] == label]
        method = t["method"].iloc[0]

        def cell(client: str, metric: str, what: str) -> str:
            r = t[(t["client"] == client) & (t["metric"] == metric)]
            if r.empty:
                return "missing"
            r = r.iloc[0]
            if what == "ours":
                return fmt(r["ours_mean"], r["ours_std"], r["n_seeds"])
            if r["paper"] is None or (isinstance(r["paper"], float) and math.isnan(r["paper"])):
                return "–"
            if what == "paper":
                return f"{r['paper']:.2f}"
            return "–" if r["diff"] is None or pd.isna(r["diff"]) else f"{r['diff']:+.2f}"

        seeds = t.iloc[0]
        seed_text = f"{seeds['n_seeds']}" + (f" ({seeds['seeds']})" if seeds["seeds"] else "") + (
            f", missing {seeds['missing_seeds']}" if seeds["missing_seeds"] else "")
        name = published.PAPER_METHOD_NAMES.get(method, method)
        name = name if label == method else f"{name} ({label})"
        lines.append("| " + " | ".join([name, "ours", *[cell(c, m, "ours") for c in clients for m in metrics],
                                         seed_text]) + " |")
        if key:
            lines.append("| " + " | ".join(["", "paper", *[cell(c, m, "paper") for c in clients for m in metrics],
                                             ""]) + " |")
            lines.append("| " + " | ".join(["", "ours − paper",
                                             *[cell(c, m, "diff") for c in clients for m in metrics], ""]) + " |")
    if compared is not None:
        lines.append(comparisons.markdown_section(compared, "main", bootstrap or BootstrapConfig()))
    return "\n".join(lines) + "\n"


def study_table_markdown(agg: pd.DataFrame, study: str, compared: pd.DataFrame | None = None,
                         bootstrap: BootstrapConfig | None = None) -> str:
    sub = agg[agg["study"] == study]
    lines = [f"# Study `{study}`", "",
             f"ROUGE F1 x 100 per client, mean ± sample std over seeds ((n=1): one seed, no spread; R-L = "
             f"`{TABLE_ROUGE_L}`; avg = mean of R-1, R-2, R-L). \"significantly vs\": the baselines whose avg this "
             "configuration is above (>) or below (<) with a paired interval excluding 0 (section below).", "",
             "| configuration | backbone | client | R-1 | R-2 | R-L | avg | significantly vs | seeds | missing seeds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in sub.sort_values(["label", "backbone", "client"]).iterrows():
        marks = "–" if compared is None else comparisons.significance_marks(compared, study, r["label"], r["client"])
        lines.append("| " + " | ".join([
            str(r["label"]), str(r["backbone"]), str(r["client"]),
            *[fmt(r[f"{m}_mean"], r[f"{m}_std"], r["n_seeds"]) for m in METRICS], marks, str(r["n_seeds"]),
            r["missing_seeds"] or "–",
        ]) + " |")
    if compared is not None:
        lines.append(comparisons.markdown_section(compared, study, bootstrap or BootstrapConfig()))
    return "\n".join(lines) + "\n"


EXPERIMENT_STAGE = re.compile(r"^(train|evaluate)-(?P<experiment>.+)$")


def timing_table(timing_dir: Path, planned_names: set[str]) -> tuple[pd.DataFrame | None, list[str]]:
    """The stage timing records, longest first, and the stages left out: train-/evaluate- records of experiments
    params.yaml no longer plans (DVC leaves a removed stage's outputs in place)."""
    files = sorted(timing_dir.glob("*.json")) if timing_dir.is_dir() else []
    rows, left_out = [], []
    for f in files:
        try:
            rec = json.loads(f.read_text())
            row = {"stage": str(rec["stage"]), "seconds": float(rec["seconds"]),
                   "peak_rss_mb": float(rec["peak_rss_mb"]), "finished_at": str(rec.get("finished_at", ""))}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise DataError(f"{f}: not a stage timing record ({err!r}); expected stage, seconds, peak_rss_mb") from err
        m = EXPERIMENT_STAGE.match(row["stage"])
        if m and m["experiment"] not in planned_names:
            left_out.append(row["stage"])
            continue
        rows.append(row)
    if not rows:
        return None, left_out
    return pd.DataFrame(rows).sort_values("seconds", ascending=False).reset_index(drop=True), left_out


# ---------------------------------------------------------------------------------------------------------------
# Figures (matplotlib Agg); each figure's data is also written to reports/plots/ for `dvc plots show`.


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    atomic.savefig(fig, path, dpi=120)
    _plt().close(fig)
    return path


def grouped_bars(ax, data: pd.DataFrame, group_col: str, bar_col: str, value: str, err: str | None = None,
                 paper: dict[tuple[str, str], float] | None = None) -> None:
    """Bars of ``value`` grouped by ``group_col`` (x) with one bar per ``bar_col``; paper values as black ticks."""
    groups = list(dict.fromkeys(data[group_col]))
    bars = list(dict.fromkeys(data[bar_col]))
    width = 0.8 / max(len(bars), 1)
    paper_labelled = False
    for j, b in enumerate(bars):
        xs, ys, es, px, py = [], [], [], [], []
        for i, g in enumerate(groups):
            r = data[(data[group_col] == g) & (data[bar_col] == b)]
            if r.empty:
                continue
            x = i - 0.4 + width * (j + 0.5)
            xs.append(x)
            ys.append(float(r[value].iloc[0]))
            es.append(0.0 if err is None or pd.isna(r[err].iloc[0]) else float(r[err].iloc[0]))
            if paper and (g, b) in paper:
                px.append(x)
                py.append(paper[(g, b)])
        ax.bar(xs, ys, width, yerr=es if err else None, label=str(b), capsize=2)
        if px:
            ax.scatter(px, py, marker="_", s=300, color="black", zorder=3, label=None if paper_labelled else "paper")
            paper_labelled = True
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.legend(fontsize=7)


def bar_figure(data: pd.DataFrame, title: str, fig_path: Path, plot_path: Path, facet_col: str | None = None,
               paper: dict[tuple[str, str], float] | None = None) -> dict[str, str]:
    """Average ROUGE per client (x) and configuration (bars), one panel per ``facet_col`` value."""
    plt = _plt()
    facets = list(dict.fromkeys(data[facet_col])) if facet_col else [None]
    fig, axes = plt.subplots(1, len(facets), figsize=(5.5 * len(facets), 4.0), squeeze=False, sharey=True)
    # Each bar says its number of seeds; one seed has no error bar (its spread is unknown, not zero).
    shown = data.assign(label=[f"{lab} (n={int(n)})" for lab, n in zip(data["label"], data["n_seeds"])])
    paper_shown = {(c, f"{lab} (n={int(n)})"): paper[(c, lab)] for c, lab, n in
                   zip(data["client"], data["label"], data["n_seeds"]) if (c, lab) in paper} if paper else None
    for ax, facet in zip(axes[0], facets):
        d = shown if facet is None else shown[shown[facet_col] == facet]
        grouped_bars(ax, d, "client", "label", "avg_rouge_mean", "avg_rouge_std", paper_shown)
        if facet is not None:
            ax.set_title(str(facet), fontsize=9)
    axes[0][0].set_ylabel("average ROUGE (R-1, R-2, R-L), ± std over n seeds")
    backbones = ", ".join(sorted(set(data["backbone"].astype(str))))
    fig.suptitle(f"{title}\nours: backbone {backbones}", fontsize=10)
    _save(fig, fig_path)
    out = data.copy()
    out["bar"] = out["client"] + " | " + out["label"] + (
        (" | " + out[facet_col].astype(str)) if facet_col else "")
    if paper:
        out["paper_avg_rouge"] = [paper.get((c, lab)) for c, lab in zip(out["client"], out["label"])]
    cols = ["bar", "client", "label", *([facet_col] if facet_col else []), "avg_rouge_mean", "avg_rouge_std",
            "rouge1_mean", "rouge2_mean", f"{TABLE_ROUGE_L}_mean", "n_seeds", "missing_seeds",
            *(["paper_avg_rouge"] if paper else [])]
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    atomic.to_csv(out[cols], plot_path, index=False)
    return {"figure": str(fig_path), "data": str(plot_path)}


def read_rounds(path: Path) -> pd.DataFrame:
    """Training rounds as long rows (round, client, train_loss, val_loss, ...).

    Reads the train stage's ``reports/train/<exp>/rounds.json`` (one row per round, ``<client>/<quantity>``
    columns) or ``models/<exp>/rounds.json`` (one row per round and client)."""
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(rows, list) or any(not isinstance(r, dict) or "round" not in r for r in rows):
        raise DataError(f"{path}: expected a list of per-round rows, each with 'round'")
    if not rows or "client" in rows[0]:
        return pd.DataFrame(rows)
    long: dict[tuple[int, str], dict[str, Any]] = {}
    for r in rows:
        for key, value in r.items():
            if "/" in key:
                client, quantity = key.split("/", 1)
                long.setdefault((r["round"], client), {"round": r["round"], "client": client})[quantity] = value
    return pd.DataFrame(list(long.values()))


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text).strip("_")


def learning_curves(planned: list[Planned], train_reports: Path, models_dir: Path, figures: Path,
                    plots: Path) -> list[dict[str, str]]:
    """Validation (dotted: training) loss per round per client: one figure per study, one panel per configuration,
    for the lowest seed trained. Data: ``reports/plots/learning_curves/<study>--<configuration>.csv`` (round,
    val_loss_mean, one column per client), one line per file in ``dvc plots show``."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    labels = with_labels(planned)
    by_study: dict[str, dict[str, tuple[int, Path]]] = defaultdict(dict)
    for p in planned:
        path = train_reports / p.name / "rounds.json"
        path = path if path.is_file() else models_dir / p.name / "rounds.json"
        if not path.is_file():
            continue
        current = by_study[p.study].get(labels[p.name])
        if current is None or p.seed < current[0]:
            by_study[p.study][labels[p.name]] = (p.seed, path)
    made = []
    for study, runs in sorted(by_study.items()):
        frames = {label: read_rounds(path) for label, (_, path) in sorted(runs.items())}
        frames = {k: v for k, v in frames.items() if not v.empty and "val_loss" in v}
        if not frames:
            continue
        fig, axes = plt.subplots(1, len(frames), figsize=(4.2 * len(frames), 3.4), squeeze=False, sharey=True)
        data_paths = []
        for ax, (label, df) in zip(axes[0], frames.items()):
            df = df[df["val_loss"].notna()]
            for client, cdf in df.groupby("client", sort=True):
                cdf = cdf.sort_values("round")
                line = ax.plot(cdf["round"], cdf["val_loss"], marker="o", label=f"{client} val")[0]
                if "train_loss" in cdf and cdf["train_loss"].notna().any():
                    ax.plot(cdf["round"], cdf["train_loss"], linestyle=":", color=line.get_color(),
                            label=f"{client} train")
            ax.set_title(f"{study}: {label} (seed {runs[label][0]})", fontsize=9)
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=6)
            wide = df.pivot_table(index="round", columns="client", values="val_loss").sort_index()
            wide.insert(0, "val_loss_mean", wide.mean(axis=1))
            data_path = plots / "learning_curves" / f"{study}--{slug(label)}.csv"
            data_path.parent.mkdir(parents=True, exist_ok=True)
            atomic.to_csv(wide.reset_index(), data_path, index=False)
            data_paths.append(str(data_path))
        axes[0][0].set_ylabel("loss per target token")
        fig_path = _save(fig, figures / f"learning_curves_{study}.png")
        made.append({"figure": str(fig_path), "data": data_paths, "study": study})
    return made


# ---------------------------------------------------------------------------------------------------------------
# Predictions (case study, human evaluation)


def read_predictions(path: Path) -> dict[str, Prediction]:
    out = {}
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out[rec["example_id"]] = Prediction(rec["experiment"], rec["example_id"], rec["domain"],
                                                rec["prediction"], rec["reference"])
        except (json.JSONDecodeError, KeyError) as err:
            raise DataError(f"{path}:{line_no}: not a prediction record ({err!r})") from err
    return out


def predictions_by_method(planned: list[Planned], eval_dir: Path, study: str = "main",
                          seed: int | None = None) -> tuple[dict[str, dict[str, Prediction]], int | None]:
    """method -> example_id -> Prediction for one study and seed (default: the lowest seed with predictions)."""
    avail = [p for p in planned if p.study == study and (eval_dir / p.name / "predictions.jsonl").is_file()]
    if not avail:
        return {}, None
    chosen_seed = min(p.seed for p in avail) if seed is None else seed
    out: dict[str, dict[str, Prediction]] = {}
    for p in sorted(avail, key=lambda p: p.name):
        if p.seed == chosen_seed and p.method not in out:
            out[p.method] = read_predictions(eval_dir / p.name / "predictions.jsonl")
    return out, chosen_seed


def example_info(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """example_id -> query, example_id -> meeting_id (empty when the examples file is absent)."""
    if not path.is_file():
        return {}, {}
    df = pd.read_parquet(path, columns=["example_id", "query", "meeting_id"])
    return dict(zip(df["example_id"], df["query"].fillna(""))), dict(zip(df["example_id"], df["meeting_id"]))


def case_study(preds: dict[str, dict[str, Prediction]], queries: dict[str, str], seed: int,
               methods: tuple[str, str] = ("fedavg", "fedselectkd")) -> str | None:
    """One test example per domain: FedAvg's and SelectKD's summary and the gold one (seeded choice)."""
    if not all(m in preds for m in methods):
        return None
    from pipeline.results.scoring import Scorer

    scorer = Scorer()
    common = sorted(set(preds[methods[0]]) & set(preds[methods[1]]))
    by_domain: dict[str, list[str]] = defaultdict(list)
    for ex in common:
        by_domain[preds[methods[0]][ex].domain].append(ex)
    rng = random.Random(f"case_study:{seed}")
    lines = ["# Case study", "",
             "One test example per domain, chosen at random (seeded, `report.case_study_seed`), summarised by each "
             "client's own model; ROUGE F1 x 100 of each summary against the gold one.", ""]
    for domain in sorted(by_domain):
        ex = rng.choice(by_domain[domain])
        gold = preds[methods[0]][ex].reference
        lines += [f"## {domain}", "", f"Example `{ex}`", ""]
        if queries.get(ex):
            lines += [f"**Query:** {queries[ex]}", ""]
        for m in methods:
            p = preds[m][ex]
            s = scorer.score(p.prediction, gold)
            lines += [f"**{published.PAPER_METHOD_NAMES.get(m, m)}** (R-1 {s['rouge1']:.1f}, R-2 {s['rouge2']:.1f}, "
                      f"R-L {s[TABLE_ROUGE_L]:.1f}; `{p.experiment}`): {p.prediction}", ""]
        lines += [f"**Gold:** {gold}", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The stage


STUDY_FIGURES = {
    "iid": "IID and balanced (each client a third of every domain)",
    "noniid": "Non-IID and balanced (200/40/40 per domain)",
    "extreme": "Extreme non-IID and unbalanced (SAMSum as a 4th client)",
    "sampling": "Client sampling (2 of 3 clients per round)",
    "server": "Server algorithms",
    "new_client": "New client (SAMSum joins)",
}


def with_pre_addition(agg: pd.DataFrame) -> pd.DataFrame:
    """Pre-addition (SAMSum a client from round 1) is the same computation as the extreme study's SelectKD run,
    so a profile may run it once, there: when study `new_client` has no pre_addition rows, the extreme study's
    fedselectkd rows stand in, labelled as such."""
    new_client = agg[agg["study"] == "new_client"]
    if new_client.empty or "pre_addition" in set(new_client["method"]):
        return agg
    pre = agg[(agg["study"] == "extreme") & (agg["method"] == "fedselectkd")].copy()
    pre["study"], pre["method"] = "new_client", "pre_addition"
    pre["label"] = "pre_addition (= " + pre["label"].astype(str) + " of study extreme)"
    return pd.concat([agg, pre], ignore_index=True)


def build_report(params: dict[str, Any], cfg: ReportConfig, paths: Paths) -> dict[str, Any]:
    """Everything the stage writes; returns the index (what was made and what is missing)."""
    bootstrap = from_dict(BootstrapConfig, params.get("bootstrap"), "bootstrap")  # before anything is written
    planned = planned_experiments(params, paths.plans_dir)
    scores, missing_eval = collect_scores(planned, paths.eval_dir)
    agg = with_pre_addition(aggregate(scores, planned, cfg.expected_seeds))
    for d in (paths.tables, paths.figures, paths.plots):
        d.mkdir(parents=True, exist_ok=True)
    made: dict[str, list[str]] = defaultdict(list)
    not_made: dict[str, str] = {}

    # Which differences are real: every configuration against its baselines (paired bootstrap).
    compared, notes = comparisons.comparisons_table(
        comparisons.configurations(planned, with_labels(planned)), cfg.baselines, paths.eval_dir, bootstrap)
    atomic.to_csv(compared, paths.tables / "comparisons.csv", index=False)
    made["tables"].append(str(paths.tables / "comparisons.csv"))
    if notes:
        not_made["comparisons"] = "; ".join(notes)

    # Per-experiment and aggregated scores, machine-readable.
    atomic.to_csv(scores, paths.tables / "scores_per_experiment.csv", index=False)
    atomic.to_csv(agg, paths.tables / "scores_aggregated.csv", index=False)
    made["tables"] += [str(paths.tables / "scores_per_experiment.csv"), str(paths.tables / "scores_aggregated.csv")]

    # Main table per backbone (Table III layout) beside the published numbers.
    main = agg[agg["study"] == "main"]
    if main.empty:
        not_made["main table"] = "no evaluated experiment of study `main`"
    for backbone in sorted(set(main["backbone"])):
        table = main_table(agg, backbone, planned, cfg.expected_seeds)
        stem = paths.tables / f"main_{backbone_slug(backbone)}"
        atomic.to_csv(table, stem.with_suffix(".csv"), index=False)
        atomic.write_text(stem.with_suffix(".md"), main_table_markdown(table, backbone, compared, bootstrap))
        made["tables"] += [str(stem.with_suffix(".md")), str(stem.with_suffix(".csv"))]

    # One table per study, with its paired comparisons.
    for study in sorted(set(agg["study"])):
        path = paths.tables / f"study_{study}.md"
        atomic.write_text(path, study_table_markdown(agg, study, compared, bootstrap))
        made["tables"].append(str(path))

    # Figures.
    def study_rows(study: str) -> pd.DataFrame:
        return agg[agg["study"] == study].copy()

    for study in ("iid", "noniid"):
        d = study_rows(study)
        if d.empty:
            not_made[f"figure {study}"] = f"no evaluated experiment of study `{study}`"
            continue
        made["figures"].append(bar_figure(d, STUDY_FIGURES[study], paths.figures / f"{study}.png",
                                          paths.plots / f"{study}.csv")["figure"])

    d = study_rows("extreme")
    if d.empty:
        not_made["figure extreme"] = "no evaluated experiment of study `extreme`"
    else:
        has_samsum = {lab for lab in d["label"] if "SAMSum" in set(d[d["label"] == lab]["client"])}
        d["setting"] = ["with SAMSum" if lab in has_samsum else "without SAMSum" for lab in d["label"]]
        if (d["setting"] == "without SAMSum").sum() == 0:
            # The 3-client runs of the same methods in the main study are the "without" setting.
            base = study_rows("main")
            base = base[base["method"].isin(set(d["method"]))].copy()
            base["setting"] = "without SAMSum (main study)"
            d = pd.concat([d, base], ignore_index=True)
        made["figures"].append(bar_figure(d, STUDY_FIGURES["extreme"], paths.figures / "extreme.png",
                                          paths.plots / "extreme.csv", facet_col="setting")["figure"])

    d = study_rows("sampling")
    if d.empty:
        not_made["figure sampling"] = "no evaluated experiment of study `sampling`"
    else:
        d["setting"] = "2 of 3 clients per round"
        base = study_rows("main")
        base = base[base["method"].isin(set(d["method"]))].copy()
        base["setting"] = "all clients every round (main study)"
        d = pd.concat([base, d], ignore_index=True)
        made["figures"].append(bar_figure(d, STUDY_FIGURES["sampling"], paths.figures / "sampling.png",
                                          paths.plots / "sampling.csv", facet_col="setting")["figure"])

    # The tau sweep's figure (ROUGE and KD usage against tau, with the main study's tau) is the analyze stage's
    # reports/analysis/figures/tau_sweep.png; its table is tables/study_tau_sweep.md below.

    def with_main_baselines(d: pd.DataFrame, methods: tuple[str, ...]) -> pd.DataFrame:
        """Add the main study's runs of ``methods`` the study itself did not run (same 3-client setting)."""
        base = study_rows("main")
        base = base[base["method"].isin([m for m in methods if m not in set(d["method"])])]
        return pd.concat([d, base], ignore_index=True) if not d.empty else d

    d = with_main_baselines(study_rows("server"), ("fedavg", "fedselectkd"))
    if d.empty:
        not_made["figure server"] = "no evaluated experiment of study `server`"
    else:
        paper = {(c, m): v for m, by_c in published.SERVER_AVG_ROUGE.items() for c, v in by_c.items()}
        paper = {(c, lab): paper[(c, m)] for lab, m in zip(d["label"], d["method"]) for c in QMSUM if (c, m) in paper}
        made["figures"].append(bar_figure(d, STUDY_FIGURES["server"] + " (paper: BART-large)",
                                          paths.figures / "server.png", paths.plots / "server.csv",
                                          paper=paper)["figure"])

    d = with_main_baselines(study_rows("new_client"), ("fedselectkd",))
    if d.empty:
        not_made["figure new_client"] = "no evaluated experiment of study `new_client`"
    else:
        key_of = {"post_addition": "post_addition", "pre_addition": "pre_addition", "fedselectkd": "three_clients"}
        paper = {(c, lab): published.NEW_CLIENT_AVG_ROUGE[key_of[m]][c] for lab, m in zip(d["label"], d["method"])
                 if m in key_of for c in published.NEW_CLIENT_AVG_ROUGE[key_of[m]]}
        made["figures"].append(bar_figure(d, STUDY_FIGURES["new_client"] + " (paper: BART-large)",
                                          paths.figures / "new_client.png", paths.plots / "new_client.csv",
                                          paper=paper)["figure"])

    curves = learning_curves(planned, paths.train_reports, paths.models_dir, paths.figures, paths.plots)
    made["figures"] += [c["figure"] for c in curves]
    if not curves:
        not_made["learning curves"] = "no reports/train/<exp>/rounds.json of a planned experiment"

    # Case study and human-evaluation sheets from the main study's lowest evaluated seed.
    preds, pred_seed = predictions_by_method(planned, paths.eval_dir, "main")
    queries, meetings = example_info(paths.examples)
    text = case_study(preds, queries, cfg.case_study_seed) if preds else None
    if text is None:
        not_made["case study"] = "needs predictions of both fedavg and fedselectkd in study `main`"
    else:
        atomic.write_text(paths.tables / "case_study.md", text)
        made["tables"].append(str(paths.tables / "case_study.md"))
    sheets_dir = paths.human_eval / "sheets"
    if cfg.human_eval_target in preds and len(preds) > 1:
        summary = make_sheets(preds, sheets_dir, target=cfg.human_eval_target, queries=queries, meetings=meetings,
                              per_domain=cfg.human_eval_per_domain, seed=cfg.human_eval_seed)
        made["human evaluation"] = [str(sheets_dir / f) for f in ("sheet.csv", "sheet.html", "key.json")]
        made["human evaluation"].append(f"{summary['items']} comparisons, {summary['examples_per_domain']} "
                                        f"examples per domain, seed {pred_seed} runs")
    else:
        sheets_dir.mkdir(parents=True, exist_ok=True)
        not_made["human evaluation sheets"] = (f"needs predictions of {cfg.human_eval_target} and at least one other "
                                               "method in study `main`")

    timing, stale_timing = timing_table(paths.timing_dir, {p.name for p in planned})
    if stale_timing:
        not_made["stage times of unplanned experiments"] = f"left out of the stage-time table: {', '.join(stale_timing)}"
    if timing is None:
        not_made["stage times"] = "no reports/timing/*.json"
    else:
        atomic.to_csv(timing, paths.tables / "timing.csv", index=False)
        lines = ["# Stage wall times", "", "Each stage's last run (its `reports/timing/<stage>.json`); the sum leaves out "
                 "process start-up (imports) and DVC's own work between stages.", "",
                 "| stage | seconds | peak RSS (MB) | finished (UTC) |", "|---|---|---|---|"]
        lines += [f"| {r.stage} | {r.seconds:.1f} | {r.peak_rss_mb:.0f} | {r.finished_at} |" for r in timing.itertuples()]
        lines.append(f"| **total** | {timing['seconds'].sum():.1f} | {timing['peak_rss_mb'].max():.0f} (max) | |")
        atomic.write_text(paths.tables / "timing.md", "\n".join(lines) + "\n")
        made["tables"] += [str(paths.tables / "timing.md"), str(paths.tables / "timing.csv")]

    summary = summary_metrics(agg, planned, missing_eval)
    atomic.write_json(paths.out / "summary.json", summary, sort_keys=True)
    intervals = {c.label: average_interval(c, paths.eval_dir, bootstrap)
                 for c in comparisons.configurations(planned, with_labels(planned)) if c.study == HEADLINE_STUDY}
    kd = json.loads(paths.kd_analysis.read_text()) if paths.kd_analysis.is_file() else {}
    atomic.write_json(paths.out / "metrics.json", headline_metrics(agg, intervals, kd), sort_keys=True)
    # Evaluations of experiments no longer in params.yaml are left out of every table; say which.
    planned_names = {p.name for p in planned}
    ignored = sorted(d.name for d in paths.eval_dir.iterdir()
                     if d.is_dir() and d.name not in planned_names) if paths.eval_dir.is_dir() else []
    index = {"made": dict(made), "not_made": not_made, "missing_experiments": missing_eval,
             "incomplete_seeds": incomplete(agg), "ignored_evaluations": ignored}
    atomic.write_text(paths.out / "README.md", readme(index, planned, paths))
    return index


def incomplete(agg: pd.DataFrame) -> list[str]:
    rows = agg[agg["missing_seeds"] != ""] if not agg.empty else agg
    seen = dict.fromkeys(f"{r.study}: {r.label} (missing seed {r.missing_seeds})" for r in rows.itertuples())
    return list(seen)


def summary_metrics(agg: pd.DataFrame, planned: list[Planned], missing_eval: list[str]) -> dict[str, Any]:
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
    """Bootstrap interval of a configuration's client-average avg ROUGE over its seeds (pipeline.results.stats): the test
    examples every seed has, resampled within clients, seeds resampled when there are several. None without any
    per-example scores."""
    frames = [f for _, name in config.runs if (f := comparisons.per_example(eval_dir, name)) is not None]
    if not frames:
        return None
    per_client = []
    for client in sorted(set.intersection(*(set(f["client"]) for f in frames))):
        ids = sorted(set.intersection(*(set(f.loc[f["client"] == client, "example_id"]) for f in frames)))
        if ids:
            per_client.append(pd.DataFrame([f[f["client"] == client].set_index("example_id").loc[ids, "avg_rouge"]
                                            for f in frames]).to_numpy(dtype=float))
    if not per_client:
        return None
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


def readme(index: dict[str, Any], planned: list[Planned], paths: Paths) -> str:
    def rel(p: str | Path) -> str:
        return os.path.relpath(p, paths.out)

    lines = ["# fedmeet reports", "",
             "Generated by `dvc repro report` (`python -m pipeline.report`). ROUGE is F1 x 100 from `rouge-score` with "
             f"Porter stemming; the tables' R-L is `{TABLE_ROUGE_L}` (summary-level, sentence-split, as ROUGE-1.5.5 "
             "scores one-sentence-per-line files). Every number is a mean over the seeds present; missing seeds are "
             "printed beside it.", "",
             f"Experiments planned: {len(planned)}; evaluated: {len(planned) - len(index['missing_experiments'])}.", ""]
    for section in ("tables", "figures", "human evaluation"):
        items = index["made"].get(section, [])
        if items:
            lines += [f"## {section.capitalize()}", ""]
            lines += [f"- [{rel(i)}]({rel(i)})" if Path(i).exists() else f"- {i}" for i in items]
            lines.append("")
    plots = sorted(paths.plots.rglob("*.csv")) if paths.plots.is_dir() else []
    if plots:
        lines += ["## Plot data (`dvc plots show`)", ""] + [f"- [{rel(p)}]({rel(p)})" for p in plots] + [""]
    others = [p for pattern in ("data/*.md", "data/*.json", "partitions/*.png", "analysis/*.json", "analysis/*.csv",
                                "analysis/figures/*.png", "backbone.json",
                                "eval/*/metrics.json")
              for p in sorted(paths.out.glob(pattern))]
    if others:
        lines += ["## Other stage outputs", ""] + [f"- [{rel(p)}]({rel(p)})" for p in others] + [""]
    lines += ["## Not produced", ""]
    if not index["not_made"] and not index["missing_experiments"] and not index["incomplete_seeds"]:
        lines.append("Nothing: every planned experiment is evaluated with every expected seed.")
    for what, why in sorted(index["not_made"].items()):
        lines.append(f"- {what}: {why}")
    if index["missing_experiments"]:
        lines += ["", "Planned experiments without an evaluation (`reports/eval/<exp>/metrics.json`):", ""]
        lines += [f"- `{name}`" for name in index["missing_experiments"]]
    if index["ignored_evaluations"]:
        lines += ["", "Evaluations left out because their experiment is not in params.yaml `experiments`:", ""]
        lines += [f"- `reports/eval/{name}`" for name in index["ignored_evaluations"]]
    if index["incomplete_seeds"]:
        lines += ["", "Configurations averaged over fewer seeds than expected (`report.expected_seeds`):", ""]
        lines += [f"- {x}" for x in index["incomplete_seeds"]]
    lines += ["", "## Human evaluation", "",
              "Blind sheets: `reports/human_eval/sheets/` (give annotators `sheet.html` or `sheet.csv`, never "
              "`key.json`). Copy the sheets elsewhere, fill the `judgement` column (A, B or tie) or download it from "
              "the HTML page as `sheet_<name>.csv`, then run "
              "`python -m pipeline.report human --sheets DIR` -> `reports/human_eval/results.json` and "
              "`reports/human_eval/human_eval.png` (paper: SelectKD vs FedAvg 52 wins, 4 ties, 4 losses of 60).", ""]
    return "\n".join(lines)


def human_main(args: argparse.Namespace, cfg: ReportConfig, params: dict[str, Any]) -> int:
    paths = Paths(Path("."))
    if args.make_sheets:
        planned = planned_experiments(params, paths.plans_dir)
        preds, seed = predictions_by_method(planned, paths.eval_dir, args.study, args.seed)
        if not preds:
            raise DataError(f"{paths.eval_dir}: no predictions.jsonl of study {args.study!r} (run the evaluate stage)")
        queries, meetings = example_info(paths.examples)
        summary = make_sheets(preds, args.make_sheets, target=cfg.human_eval_target, queries=queries,
                              meetings=meetings, per_domain=cfg.human_eval_per_domain, seed=cfg.human_eval_seed)
        print(json.dumps({**summary, "study": args.study, "experiment_seed": seed}, indent=2))
        return 0
    results = score_sheets(args.sheets)
    results["published"] = published.HUMAN_EVAL
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_json(out / "results.json", results)
    plot_results(results, published.HUMAN_EVAL, out / "human_eval.png")
    print(json.dumps(results["opponents"], indent=2))
    print(f"wrote {out / 'results.json'} and {out / 'human_eval.png'}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="params.yaml")
    sub = parser.add_subparsers(dest="command")
    human = sub.add_parser("human", help="human-evaluation kit")
    mode = human.add_mutually_exclusive_group(required=True)
    mode.add_argument("--make-sheets", metavar="DIR", help="write blind pairwise sheets (+ key.json) into DIR")
    mode.add_argument("--sheets", metavar="DIR", help="score the filled sheet*.csv files in DIR (key.json beside them)")
    human.add_argument("--study", default="main", help="study whose predictions the sheets compare (--make-sheets)")
    human.add_argument("--seed", type=int, default=None, help="experiment seed (default: the lowest evaluated)")
    human.add_argument("--out", default="reports/human_eval", help="where results.json and the chart go (--sheets)")
    args = parser.parse_args(argv)
    params = load_params(args.params)
    cfg = from_dict(ReportConfig, params.get("report"), "report")
    try:
        if args.command == "human":
            return human_main(args, cfg, params)
        from pipeline.common.timing import stage_timer

        with stage_timer("report"):
            index = build_report(params, cfg, Paths(Path(".")))
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"made": {k: len(v) for k, v in index["made"].items()}, "not_made": index["not_made"],
                      "missing_experiments": len(index["missing_experiments"])}, indent=2))
    return 0


if __name__ == "__main__":
    from pipeline.common.cli import run as run_cli

    sys.exit(run_cli(main))
