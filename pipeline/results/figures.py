"""The report's figures (matplotlib Agg): bar charts of average ROUGE per client and configuration, and learning
curves; each figure's data also in ``reports/plots/`` for `dvc plots show`."""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Iterable

import matplotlib
import pandas as pd

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from pipeline.common import atomic  # noqa: E402
from pipeline.experiments import Experiment  # noqa: E402
from pipeline.results.readers import read_rounds  # noqa: E402
from pipeline.results.scoring import TABLE_ROUGE_L  # noqa: E402


def save(fig, path: Path) -> Path:
    """Lay out, write (atomically, 120 dpi; its folder created) and close a figure."""
    fig.tight_layout()
    atomic.savefig(fig, path, dpi=120)
    plt.close(fig)
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
    save(fig, fig_path)
    out = data.copy()
    out["bar"] = out["client"] + " | " + out["label"] + (
        (" | " + out[facet_col].astype(str)) if facet_col else "")
    if paper:
        out["paper_avg_rouge"] = [paper.get((c, lab)) for c, lab in zip(out["client"], out["label"])]
    cols = ["bar", "client", "label", *([facet_col] if facet_col else []), "avg_rouge_mean", "avg_rouge_std",
            "rouge1_mean", "rouge2_mean", f"{TABLE_ROUGE_L}_mean", "n_seeds", "missing_seeds",
            *(["paper_avg_rouge"] if paper else [])]
    atomic.to_csv(out[cols], plot_path, index=False)
    return {"figure": str(fig_path), "data": str(plot_path)}


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text).strip("_")


def learning_curves(planned: Iterable[Experiment], labels: dict[str, str], train_reports: Path, figures: Path,
                    plots: Path) -> list[dict[str, str]]:
    """Validation (dotted: training) loss per round per client: one figure per study, one panel per configuration
    (its lowest seed trained); data in ``reports/plots/learning_curves/<study>--<configuration>.csv``."""
    by_study: dict[str, dict[str, tuple[int, Path]]] = defaultdict(dict)
    for p in planned:
        path = train_reports / p.name / "rounds.json"
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
            atomic.to_csv(wide.reset_index(), data_path, index=False)
            data_paths.append(str(data_path))
        axes[0][0].set_ylabel("loss per target token")
        fig_path = save(fig, figures / f"learning_curves_{study}.png")
        made.append({"figure": str(fig_path), "data": data_paths, "study": study})
    return made
