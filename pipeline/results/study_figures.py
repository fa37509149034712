"""The registry of the study figures the report draws: one :class:`StudyFigure` entry per study (its title, the
rows its bars show, its panels, the paper's values beside ours, rows another study's runs stand in for). Every study
gets its table without an entry here; adding a study's figure is one entry in :data:`STUDY_FIGURES`. The privacy
study has a figure of its own: ROUGE against the epsilon its runs spent (:func:`privacy_points`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd

from pipeline.common import atomic
from pipeline.experiments import Experiment
from pipeline.results import published
from pipeline.results.figures import bar_figure, plt, save
from pipeline.results.readers import read_json

# (client, configuration label) -> the paper's average ROUGE
PaperValues = dict[tuple[str, str], float]


def main_rows_of(agg: pd.DataFrame, methods: set[str]) -> pd.DataFrame:
    """The main study's (3-client, every round) rows of ``methods``."""
    return agg[(agg["study"] == "main") & agg["method"].isin(methods)].copy()


def with_main_baselines(*methods: str) -> Callable[[pd.DataFrame, pd.DataFrame], pd.DataFrame]:
    """Bars: the study's rows plus the main study's runs of ``methods`` the study itself did not run."""
    def bars(rows: pd.DataFrame, agg: pd.DataFrame) -> pd.DataFrame:
        base = main_rows_of(agg, {m for m in methods if m not in set(rows["method"])})
        return pd.concat([rows, base], ignore_index=True)

    return bars


def extreme_bars(rows: pd.DataFrame, agg: pd.DataFrame) -> pd.DataFrame:
    """Panels with and without SAMSum as a 4th client."""
    has_samsum = {lab for lab in rows["label"] if "SAMSum" in set(rows[rows["label"] == lab]["client"])}
    rows["setting"] = ["with SAMSum" if lab in has_samsum else "without SAMSum" for lab in rows["label"]]
    if (rows["setting"] == "without SAMSum").sum() == 0:
        # The 3-client runs of the same methods in the main study are the "without" setting.
        base = main_rows_of(agg, set(rows["method"])).assign(setting="without SAMSum (main study)")
        rows = pd.concat([rows, base], ignore_index=True)
    return rows


def sampling_bars(rows: pd.DataFrame, agg: pd.DataFrame) -> pd.DataFrame:
    """Panels: the main study's runs of the same methods (every client every round) beside the sampled ones."""
    base = main_rows_of(agg, set(rows["method"])).assign(setting="all clients every round (main study)")
    return pd.concat([base, rows.assign(setting="2 of 3 clients per round")], ignore_index=True)


def server_paper(bars: pd.DataFrame) -> PaperValues:
    paper = {(c, m): v for m, by_c in published.SERVER_AVG_ROUGE.items() for c, v in by_c.items()}
    return {(c, lab): paper[(c, m)] for lab, m in zip(bars["label"], bars["method"])
            for c in published.QMSUM_CLIENTS if (c, m) in paper}


def new_client_paper(bars: pd.DataFrame) -> PaperValues:
    key_of = {"post_addition": "post_addition", "pre_addition": "pre_addition", "fedselectkd": "three_clients"}
    return {(c, lab): published.NEW_CLIENT_AVG_ROUGE[key_of[m]][c] for lab, m in zip(bars["label"], bars["method"])
            if m in key_of for c in published.NEW_CLIENT_AVG_ROUGE[key_of[m]]}


def pre_addition_stand_in(agg: pd.DataFrame) -> pd.DataFrame:
    """Pre-addition (SAMSum a client from round 1) is the same computation as the extreme study's SelectKD run,
    so a profile may run it once, there: when study `new_client` has no pre_addition rows, the extreme study's
    fedselectkd rows stand in, labelled as such."""
    new_client = agg[agg["study"] == "new_client"]
    if new_client.empty or "pre_addition" in set(new_client["method"]):
        return agg
    pre = agg[(agg["study"] == "extreme") & (agg["method"] == "fedselectkd")]
    pre = pre.assign(study="new_client", method="pre_addition",
                     label="pre_addition (= " + pre["label"].astype(str) + " of study extreme)")
    return pd.concat([agg, pre], ignore_index=True)


@dataclass(frozen=True)
class StudyFigure:
    """One study's bar chart: ``reports/figures/<study>.png``, its data in ``reports/plots/<study>.csv``."""

    study: str  # its METHOD.md section and description: pipeline.results.evaluation.STUDIES
    title: str
    # (study rows, all rows) -> the bars drawn (None: the study's own rows)
    bars: Callable[[pd.DataFrame, pd.DataFrame], pd.DataFrame] | None = None
    facet_col: str | None = None  # one panel per value of this column of the bars
    paper: Callable[[pd.DataFrame], PaperValues] | None = None  # the bars -> the paper's values beside them
    stand_in: Callable[[pd.DataFrame], pd.DataFrame] | None = None  # all rows -> with rows other runs stand in for


# In the order the figures are listed in reports/README.md. The tau sweep's figure (ROUGE and KD usage against
# tau, with the main study's tau) is the analyze stage's reports/analysis/figures/tau_sweep.png; its table is
# tables/study_tau_sweep.md.
STUDY_FIGURES: tuple[StudyFigure, ...] = (
    StudyFigure("iid", "IID and balanced (each client a third of every domain)"),
    StudyFigure("noniid", "Non-IID and balanced (200/40/40 per domain)"),
    StudyFigure("extreme", "Extreme non-IID and unbalanced (SAMSum as a 4th client)", extreme_bars,
                facet_col="setting"),
    StudyFigure("sampling", "Client sampling (2 of 3 clients per round)", sampling_bars, facet_col="setting"),
    StudyFigure("server", "Server algorithms (paper: BART-large)", with_main_baselines("fedavg", "fedselectkd"),
                paper=server_paper),
    StudyFigure("new_client", "New client (SAMSum joins) (paper: BART-large)", with_main_baselines("fedselectkd"),
                paper=new_client_paper, stand_in=pre_addition_stand_in),
)


def with_stand_ins(agg: pd.DataFrame) -> pd.DataFrame:
    """The aggregated rows with every registered study's stand-in rows added."""
    for entry in STUDY_FIGURES:
        if entry.stand_in is not None:
            agg = entry.stand_in(agg)
    return agg


def study_figures(agg: pd.DataFrame, figures: Path, plots: Path) -> tuple[list[str], dict[str, str]]:
    """Draw every registered study's figure; returns the figures made and, per study without rows, why not."""
    made: list[str] = []
    not_made: dict[str, str] = {}
    for entry in STUDY_FIGURES:
        rows = agg[agg["study"] == entry.study].copy()
        if rows.empty:
            not_made[f"figure {entry.study}"] = f"no evaluated experiment of study `{entry.study}`"
            continue
        bars = entry.bars(rows, agg) if entry.bars is not None else rows
        made.append(bar_figure(bars, entry.title, figures / f"{entry.study}.png", plots / f"{entry.study}.csv",
                               facet_col=entry.facet_col,
                               paper=entry.paper(bars) if entry.paper is not None else None)["figure"])
    return made, not_made


PRIVACY_STUDY = "privacy"
PRIVACY_COLUMNS = ["method", "label", "dp", "epsilon", "delta", "target_epsilon", "noise_multiplier",
                   "avg_rouge_mean", "avg_rouge_std", "n_seeds", "backbone"]


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
    """One row per configuration of the study: its client-average ROUGE over seeds and the epsilon it spent (mean
    over seeds of spent_epsilon), no privacy at epsilon = inf."""
    members = [p for p in planned if p.study == PRIVACY_STUDY]
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
    return pd.DataFrame(rows, columns=PRIVACY_COLUMNS)


def privacy_figure(points: pd.DataFrame, figure: Path, data: Path) -> Path:
    """ROUGE against the epsilon spent, one line per method (log x; no privacy drawn at the right as inf)."""
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
