"""The report's figures (matplotlib Agg): bar charts of average ROUGE per client and configuration, the study
figures' registry, and learning curves; each figure's data also in ``reports/plots/`` for `dvc plots show`."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.ticker import MaxNLocator

from pipeline.common import atomic
from pipeline.paths import ProjectPaths
from pipeline.results import published
from pipeline.results.plotting import plt, save, slug
from pipeline.results.readers import read_json, read_rounds
from pipeline.results.scoring import TABLE_METRICS
from pipeline.results.tables import Made, ReportInputs
from pipeline.training.stopping import mean_val_loss_by_round


def bar_figure(data: pd.DataFrame, entry: StudyFigure, paths: ProjectPaths) -> str:
    """A study's figure from its bars ``data``: average ROUGE per client (x) and configuration (bars), one panel per
    value of the entry's ``facet_col``, the paper's values as black ticks; its data beside it."""
    facet_col, table = entry.facet_col, entry.paper or {}
    # the paper's average ROUGE for each row's method and client (NaN where it has none)
    data = data.assign(
        paper_avg_rouge=[table.get(m, {}).get(c, math.nan) for m, c in zip(data["method"], data["client"])]
    )
    facets = list(dict.fromkeys(data[facet_col])) if facet_col else [None]
    fig, axes = plt.subplots(1, len(facets), figsize=(5.5 * len(facets), 4.0), squeeze=False, sharey=True)
    # Each bar says its number of seeds; one seed has no error bar (its spread is unknown, not zero).
    shown = data.assign(label=[f"{lab} (n={int(n)})" for lab, n in zip(data["label"], data["n_seeds"])])
    for ax, facet in zip(axes[0], facets):
        d = shown if facet is None else shown[shown[facet_col] == facet]
        clients, width = list(dict.fromkeys(d["client"])), 0.8 / max(d["label"].nunique(), 1)
        for j, (bar, r) in enumerate(d.groupby("label", sort=False)):
            r = r.drop_duplicates("client")  # the bar's first row per client, at the client's place on the x axis
            xs = [clients.index(c) - 0.4 + width * (j + 0.5) for c in r["client"]]
            ax.bar(xs, r["avg_rouge_mean"], width, yerr=r["avg_rouge_std"].fillna(0.0), label=str(bar), capsize=2)
            if paper_xy := [(x, p) for x, p in zip(xs, r["paper_avg_rouge"]) if not math.isnan(p)]:
                first = "paper" not in [c.get_label() for c in ax.collections]  # one legend entry a panel
                ax.scatter(
                    *zip(*paper_xy), marker="_", s=300, color="black", zorder=3, label="paper" if first else None
                )
        ax.set(xticks=range(len(clients)), xticklabels=clients)
        ax.legend(fontsize=7)
        if facet is not None:
            ax.set_title(str(facet), fontsize=9)
    axes[0][0].set_ylabel("average ROUGE (R-1, R-2, R-L), ± std over n seeds")
    backbones = ", ".join(sorted(set(data["backbone"].astype(str))))
    fig.suptitle(f"{entry.title}\nours: backbone {backbones}", fontsize=10)
    out = data.assign(
        bar=data["client"] + " | " + data["label"] + (" | " + data[facet_col].astype(str) if facet_col else "")
    )
    by_facet, means = [facet_col] if facet_col else [], [f"{m}_mean" for m in TABLE_METRICS]
    cols = ["bar", "client", "label", *by_facet, "avg_rouge_mean", "avg_rouge_std", *means, "n_seeds", "missing_seeds"]
    paper = ["paper_avg_rouge"] if data["paper_avg_rouge"].notna().any() else []  # a column only where it has some
    atomic.to_csv(out[cols + paper], paths.plots / f"{entry.study}.csv", index=False)
    return str(save(fig, paths.figures / f"{entry.study}.png"))


def learning_curves(inp: ReportInputs, reports: Path, made: Made) -> int:
    """Validation (dotted: training) loss per round per client: one figure per study, one panel per configuration
    (its lowest seed trained), from ``reports/train`` into ``reports/figures`` and ``made`` (reports/ or a study
    folder); data in ``reports/plots/learning_curves/<study>--<configuration>.csv``. How many figures were drawn."""
    by_study: dict[str, dict[str, tuple[int, Path]]] = defaultdict(dict)
    for p in sorted(inp.planned, key=lambda p: p.seed):  # each configuration's lowest seed with rounds
        if (path := reports / "train" / p.name / "rounds.json").is_file():
            by_study[p.study].setdefault(inp.labels[p.name], (p.seed, path))
    drawn = 0
    for study, runs in sorted(by_study.items()):
        frames = {label: read_rounds(path) for label, (_, path) in sorted(runs.items())}
        frames = {k: v for k, v in frames.items() if not v.empty and "val_loss" in v}
        if not frames:
            continue
        fig, axes = plt.subplots(1, len(frames), figsize=(4.2 * len(frames), 3.4), squeeze=False, sharey=True)
        for ax, (label, df) in zip(axes[0], frames.items()):
            mean = pd.Series(dict(mean_val_loss_by_round(df.to_dict("records"))))  # the stop rule's client average
            df = df[df["val_loss"].notna()]
            for client, cdf in df.groupby("client", sort=True):
                cdf = cdf.sort_values("round")
                line = ax.plot(cdf["round"], cdf["val_loss"], marker="o", label=f"{client} val")[0]
                if "train_loss" in cdf and cdf["train_loss"].notna().any():
                    ax.plot(
                        cdf["round"], cdf["train_loss"], linestyle=":", color=line.get_color(), label=f"{client} train"
                    )
            ax.set_title(f"{study}: {label} (seed {runs[label][0]})", fontsize=9)
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=6)
            wide = df.pivot_table(index="round", columns="client", values="val_loss").sort_index()
            wide.insert(0, "val_loss_mean", mean.reindex(wide.index))
            csv_path = reports / "plots" / "learning_curves" / f"{study}--{slug(label)}.csv"
            atomic.to_csv(wide.reset_index(), csv_path, index=False)
        axes[0][0].set_ylabel("loss per target token")
        made.files["figures"].append(str(save(fig, reports / "figures" / f"learning_curves_{study}.png")))
        drawn += 1
    return drawn


# The study figures' registry, STUDY_FIGURES (a study's figure is one StudyFigure; every study gets its table without
# one), and the privacy study's figure.


def main_rows_of(agg: pd.DataFrame, methods: set[str]) -> pd.DataFrame:
    """The main study's (3-client, every round) rows of ``methods``."""
    return agg[(agg["study"] == "main") & agg["method"].isin(methods)].copy()


def extreme_bars(rows: pd.DataFrame, agg: pd.DataFrame) -> pd.DataFrame:
    """Panels with and without SAMSum as a 4th client."""
    has_samsum = set(rows.loc[rows["client"] == "SAMSum", "label"])
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


def pre_addition_stand_in(agg: pd.DataFrame) -> pd.DataFrame:
    """Pre-addition (SAMSum a client from round 1) is the same computation as the extreme study's SelectKD run,
    so a profile may run it once, there: when study `new_client` has no pre_addition rows, the extreme study's
    fedselectkd rows stand in, labelled as such."""
    new_client = agg[agg["study"] == "new_client"]
    if new_client.empty or "pre_addition" in set(new_client["method"]):
        return agg
    pre = agg[(agg["study"] == "extreme") & (agg["method"] == "fedselectkd")]
    pre = pre.assign(
        study="new_client",
        method="pre_addition",
        label="pre_addition (= " + pre["label"].astype(str) + " of study extreme)",
    )
    return pd.concat([agg, pre], ignore_index=True)


@dataclass(frozen=True)
class StudyFigure:
    """One study's bar chart: ``reports/figures/<study>.png``, its data in ``reports/plots/<study>.csv``."""

    study: str  # its METHOD.md section and description: pipeline.results.evaluation.STUDIES
    title: str
    # (study rows, all rows) -> the bars drawn (None: the study's own rows)
    bars: Callable[[pd.DataFrame, pd.DataFrame], pd.DataFrame] | None = None
    facet_col: str | None = None  # one panel per value of this column of the bars
    main_baselines: tuple[str, ...] = ()  # bars too: the main study's runs of these methods the study did not run
    paper: dict[str, dict[str, float]] | None = None  # the paper's values beside the bars: method -> client -> value


# In the order the figures are listed in reports/README.md. The tau sweep's figure (ROUGE and KD usage against
# tau, with the main study's tau) is the analyze stage's reports/analysis/figures/tau_sweep.png; its table is
# tables/study_tau_sweep.md.
STUDY_FIGURES: tuple[StudyFigure, ...] = (
    StudyFigure("iid", "IID and balanced (each client a third of every domain)"),
    StudyFigure("noniid", "Non-IID and balanced (200/40/40 per domain)"),
    StudyFigure(
        "extreme", "Extreme non-IID and unbalanced (SAMSum as a 4th client)", extreme_bars, facet_col="setting"
    ),
    StudyFigure("sampling", "Client sampling (2 of 3 clients per round)", sampling_bars, facet_col="setting"),
    StudyFigure(
        "server",
        "Server algorithms (paper: BART-large)",
        main_baselines=("fedavg", "fedselectkd"),
        paper=published.SERVER_AVG_ROUGE,
    ),
    StudyFigure(
        "new_client",
        "New client (SAMSum joins) (paper: BART-large)",
        main_baselines=("fedselectkd",),
        # SelectKD's run in this study is the paper's three-client setting, before SAMSum joins
        paper=published.NEW_CLIENT_AVG_ROUGE | {"fedselectkd": published.NEW_CLIENT_AVG_ROUGE["three_clients"]},
    ),
)


def study_figures(agg: pd.DataFrame, paths: ProjectPaths, made: Made) -> None:
    """Draw every registered study's figure into ``made``, and say why not for each study without rows."""
    for entry in STUDY_FIGURES:
        rows = agg[agg["study"] == entry.study].copy()
        if rows.empty:
            made.not_made[f"figure {entry.study}"] = f"no evaluated experiment of study `{entry.study}`"
            continue
        if entry.main_baselines:
            base = main_rows_of(agg, set(entry.main_baselines) - set(rows["method"]))
            rows = pd.concat([rows, base], ignore_index=True)
        bars = entry.bars(rows, agg) if entry.bars is not None else rows
        made.files["figures"].append(bar_figure(bars, entry, paths))


def spent_epsilon(train_metrics: dict) -> tuple[float, float | None, float | None, float | None]:
    """(epsilon, target, noise multiplier, delta) of one run: the largest epsilon over its clients (inf without
    DP) and the largest delta (None without DP); privacy.mode client: the run's own (inf: no bound)."""
    privacy = train_metrics.get("privacy") or {}
    if privacy.get("mode") == "client":  # clients.<c>.privacy: only their updates' clipping (docs/privacy.md)
        eps, *rest = (privacy[k] for k in ("epsilon", "target_epsilon", "noise_multiplier", "delta"))
        return (math.inf if eps is None else eps), *rest
    clients = [c["privacy"] for c in (train_metrics.get("clients") or {}).values() if "privacy" in c]
    if not privacy or not clients:
        return math.inf, None, None, None
    eps = [c["epsilon"] for c in clients]
    return (
        (math.inf if None in eps else max(eps)),
        privacy.get("target_epsilon"),
        max(c["noise_multiplier"] for c in clients),
        max((c["delta"] for c in clients if c.get("delta") is not None), default=None),
    )


def privacy_points(inp: ReportInputs, scores: pd.DataFrame, paths: ProjectPaths) -> pd.DataFrame:
    """One row per configuration of the study: its client-average ROUGE over seeds and the epsilon it spent (mean
    over seeds of spent_epsilon), no privacy at epsilon = inf."""
    rows = []
    for config in [c for c in inp.configurations if c.study == "privacy"]:
        names = [name for _, name in config.runs]
        # the seeds with scores and a train record: each one's client average and spent_epsilon
        runs = [n for n in names if (scores["experiment"] == n).any() and paths.train_metrics(n).is_file()]
        if not runs:
            continue
        series = pd.Series([float(scores.loc[scores["experiment"] == n, "avg_rouge"].mean()) for n in runs])
        spent = [spent_epsilon(read_json(paths.train_metrics(n), "train metrics")) for n in runs]
        eps, targets, sigmas, deltas = zip(*spent)
        rows.append(
            {
                "method": config.method,
                "label": config.label,
                "dp": config.dp,
                "epsilon": float(pd.Series(eps).mean()) if all(math.isfinite(e) for e in eps) else math.inf,
                "delta": max((d for d in deltas if d is not None), default=None),
                "target_epsilon": targets[0],
                "noise_multiplier": sigmas[0],
                "avg_rouge_mean": float(series.mean()),
                "avg_rouge_std": float(series.std(ddof=1)),  # NaN for one seed: its spread is unknown
                "n_seeds": len(series),
                "backbone": str(scores.loc[scores["experiment"].isin(names), "backbone"].iloc[0]),
            }
        )
    return pd.DataFrame(rows)  # no row: an empty frame, no figure


def privacy_figure(points: pd.DataFrame, paths: ProjectPaths) -> str:
    """ROUGE against the epsilon spent per method (log x; no privacy drawn at the right as inf), its data beside it."""
    atomic.to_csv(points, paths.plots / "privacy.csv", index=False)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    finite = points.loc[points["epsilon"].apply(math.isfinite), "epsilon"]
    right = (finite.max() * 4) if not finite.empty else 10.0  # where "no privacy" (epsilon = inf) is drawn
    for method, grp in points.groupby("method", sort=False):
        grp = grp.assign(x=[e if math.isfinite(e) else right for e in grp["epsilon"]]).sort_values("x")
        err = grp["avg_rouge_std"].fillna(0.0)
        ax.errorbar(grp["x"], grp["avg_rouge_mean"], yerr=err, marker="o", capsize=3, label=method)
        for r in grp.itertuples():
            ax.annotate(
                f"n={r.n_seeds}", (r.x, r.avg_rouge_mean), textcoords="offset points", xytext=(4, 4), fontsize=7
            )
    ticks = [t for t in (0.1, 0.3, 1, 3, 10, 30, 100) if finite.empty or finite.min() / 1.5 <= t <= finite.max() * 1.5]
    ax.set(xscale="log", xticks=ticks + [right], xticklabels=[f"{t:g}" for t in ticks] + ["∞ (none)"])
    ax.minorticks_off()
    backbones = ", ".join(sorted(set(points["backbone"])))
    seeds = "/".join(str(n) for n in sorted(set(points["n_seeds"])))
    deltas = points["delta"].dropna()
    held = f"delta <= {deltas.max():.3g}" if not deltas.empty else "no DP run"
    # spent_epsilon: DP-SGD's is the largest over the clients, client-level DP's the run's (privacy_label's names)
    kinds = {"client-level DP": "the run's", "DP-SGD": "largest over clients"}
    found = {k: v for k, v in kinds.items() if points["dp"].astype(str).str.startswith(k).any()}
    spent = "; ".join(f"{k}: {v}" for k, v in found.items()) if len(found) > 1 else next(iter(found.values()), "")
    ax.set(xlabel=f"epsilon spent ({spent or kinds['DP-SGD']}; {held})", ylabel="average ROUGE, client average")
    ax.set_title(f"Privacy vs utility ({backbones}; n={seeds} seeds; bars: std over seeds)", fontsize=9)
    ax.legend(fontsize=8)
    return str(save(fig, paths.figures / "privacy.png"))
