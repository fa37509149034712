"""The analyze stage's figures (matplotlib Agg) in ``reports/analysis/figures/``: the POS distribution and the
gate's entropy per round of each client, hard KD against SelectKD, and the tau sweep."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline.results.figures import plt, save
from pipeline.results.kd_analysis import HARDKD, SELECTKD
from pipeline.results.readers import METRICS


def safe_name(client: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", client)


def plot_pos(client: str, dist: dict[str, dict[str, float]], ratio: float, paper_ratio: float | None,
             path: Path) -> None:
    tags = list(dist)
    x = np.arange(len(tags))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.bar(x - 0.2, [100 * dist[t]["share_of_kd"] for t in tags], 0.4, label="trained with KD")
    ax1.bar(x + 0.2, [100 * dist[t]["share_of_no_kd"] for t in tags], 0.4, label="trained without KD")
    ax1.set_xticks(x, tags, rotation=60)
    ax1.set_ylabel("% of word updates")
    ax1.set_title("POS distribution of words trained with / without KD")
    ax1.legend()
    ax2.bar(x, [100 * dist[t]["kd_rate"] for t in tags], 0.6, color="tab:green")
    ax2.axhline(100 * ratio, color="k", ls="--", lw=1, label=f"all words: {100 * ratio:.1f} %")
    if paper_ratio is not None:
        ax2.axhline(100 * paper_ratio, color="tab:red", ls=":", lw=1, label=f"paper: {100 * paper_ratio:.0f} %")
    ax2.set_xticks(x, tags, rotation=60)
    ax2.set_ylim(0, 105)
    ax2.set_ylabel("% of the POS's word updates with KD")
    ax2.set_title("KD usage per POS")
    ax2.legend(loc="lower right")
    fig.suptitle(f"{client}: KD usage ratio {100 * ratio:.1f} % (rounds 1..best)")
    save(fig, path)


def plot_entropy(client: str, gate: pd.DataFrame, stats: pd.DataFrame, tau: float | None,
                 best: list[int], path: Path) -> None:
    rounds = sorted(gate["round"].unique())  # gate: one row per token update and round
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, 0.6 * len(rounds) + 3), 6), sharex=True,
                                   gridspec_kw={"height_ratios": [2, 1]})
    data = [gate.loc[gate["round"] == r, "entropy"].to_numpy(dtype=float) for r in rounds]
    ax1.boxplot(data, positions=rounds, whis=(5, 95), showfliers=False, widths=0.6)
    if tau is not None:
        ax1.axhline(tau, color="tab:red", ls="--", label=f"tau = {tau:g}")
        ax1.legend()
    ax1.set_ylabel("H(q_g)")
    ax1.set_title(f"{client}: H(q_g) per round (box 25-75 %, whiskers 5-95 %)", fontsize=10)
    ax2.bar(stats["round"], 100 * stats["pass_fraction"], color="tab:blue")
    for b in sorted(set(best)):
        ax2.axvline(b, color="k", ls=":", lw=1)
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("% tokens with KD")
    ax2.set_xlabel("round" + (" (dotted: best round)" if best else ""))
    ax2.set_xticks(rounds)
    save(fig, path)


def _finish_client_panels(fig, axes, clients: list[str], empty_message: str, title: str, path: Path) -> None:
    """Title and save a one-row figure of per-client panels; with no client, say why the figure is empty."""
    if not clients:
        axes[0][0].text(0.5, 0.5, empty_message, ha="center", va="center")
        axes[0][0].set_axis_off()
    fig.suptitle(title)
    save(fig, path)


def plot_hardkd(comparison: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    clients = sorted({c for per in comparison.values() for c in per})
    methods = [m for m in (SELECTKD, HARDKD) if m in comparison]
    fig, axes = plt.subplots(1, max(1, len(clients)), figsize=(4 * max(1, len(clients)), 3.8), squeeze=False)
    labels = ["R-1", "R-2", "R-L", "avg"]
    x = np.arange(len(labels))
    for ax, client in zip(axes[0], clients):
        for j, method in enumerate(methods):
            rec = comparison[method].get(client)
            if not rec:
                continue
            means = [rec["mean"][m] for m in METRICS]
            stds = [rec["std"][m] for m in METRICS]
            ax.bar(x + (j - 0.5) * 0.4, means, 0.4, yerr=stds if rec["n_seeds"] > 1 else None,
                   label=f"{'SelectKD' if method == SELECTKD else 'noun-verb hard KD'} (n={rec['n_seeds']})")
        ax.set_xticks(x, labels)
        ax.set_title(client)
        ax.set_ylabel("ROUGE F1 x 100")
        ax.legend(fontsize=8)
    _finish_client_panels(fig, axes, clients, "no evaluated SelectKD / hard-KD experiments",
                          "Noun-verb hard KD vs selective KD", path)


def plot_tau_sweep(sweep: pd.DataFrame, tau_main: float | None, path: Path) -> None:
    clients = sorted(sweep["client"].unique()) if len(sweep) else []
    fig, axes = plt.subplots(1, max(1, len(clients)), figsize=(4.2 * max(1, len(clients)), 3.6), squeeze=False)
    for ax, client in zip(axes[0], clients):
        d = sweep[sweep["client"] == client].sort_values("tau")
        ax.plot(d["tau"], d["avg_rouge"], "o-", color="tab:blue", label="avg ROUGE")
        ax.set_xlabel("tau")
        ax.set_ylabel("average ROUGE (R-1, R-2, R-L)", color="tab:blue")
        ax2 = ax.twinx()
        ax2.plot(d["tau"], 100 * d["kd_usage_ratio"], "s--", color="tab:orange", label="KD usage")
        ax2.set_ylabel("KD usage ratio (%)", color="tab:orange")
        ax2.set_ylim(0, 100)
        if tau_main is not None:
            ax.axvline(tau_main, color="grey", ls=":", lw=1)
        ax.set_title(client)
    _finish_client_panels(fig, axes, clients, "no tau-sweep experiments with results",
                          "Entropy threshold tau (dotted: main study)", path)
