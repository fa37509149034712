"""What every figure of the results shares: matplotlib without a display (Agg), :func:`save` (every figure module
saves through it) and grouped bars with the paper's values as ticks."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pandas as pd

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pipeline.common import atomic  # noqa: E402


def save(fig, path: Path) -> Path:
    """Lay out, write (atomically, 120 dpi; its folder created) and close a figure."""
    fig.tight_layout()
    atomic.savefig(fig, path, dpi=120)
    plt.close(fig)
    return path


def grouped_bars(
    ax,
    data: pd.DataFrame,
    group_col: str,
    bar_col: str,
    value: str,
    err: str | None = None,
    paper: dict[tuple[str, str], float] | None = None,
) -> None:
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
