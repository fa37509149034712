"""Why selective KD works, the computation (definitions in the docstring of pipeline/results/analysis.py): word
updates, the KD usage ratio, POS distributions, gate statistics per round, hard KD against SelectKD and the tau sweep's
points; and their figures (matplotlib Agg) in ``reports/analysis/figures/``."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline.common.schema import DataError
from pipeline.experiments.entries import Experiment
from pipeline.results.plotting import plt, save
from pipeline.results.published import KD_USAGE_RATIO
from pipeline.results.readers import METRICS

WORD_RULES = ("first", "any", "all", "majority")
SELECTKD, HARDKD = "fedselectkd", "hardkd"
# Section 7.9: determiners and pronouns are 74 % of the words trained without KD.
PAPER_DET_PRON_SHARE_OF_NON_KD = 0.74


def word_updates(
    gate: pd.DataFrame,
    postags: pd.DataFrame,
    word_rule: str = "first",
    source: str = "gate log",
    tags_source: str = "the POS tags",
) -> pd.DataFrame:
    """Token gate decisions as word updates (pipeline/results/analysis.py): one row per (client, round, example_id,
    word_index), its POS and whether its update used KD; ``source``, ``tags_source``: the files, in errors."""
    keys = ["client", "round", "example_id", "position"]
    per_token = (
        gate.groupby(keys, sort=False).agg(token_id=("token_id", "first"), kd_any=("kd_applied", "max")).reset_index()
    )
    tags = postags[["example_id", "position", "token_id", "word_index", "pos", "is_noun_or_verb"]].rename(
        columns={"token_id": "tagged_token_id"}
    )
    merged = per_token.merge(tags, on=["example_id", "position"], how="left", validate="many_to_one")
    tagged = merged["tagged_token_id"]
    differ = tagged.fillna(-1).astype(np.int64) != merged["token_id"].astype(np.int64)
    for problem, bad in {  # in this order (an untagged token differs too); ``r``: the first bad row
        "trained tokens have no POS tag in {t} (e.g. example {r[example_id]} position {r[position]}); re-run the "
        "postag stage over these examples": tagged.isna(),
        "tokens differ from {t} (e.g. example {r[example_id]} position {r[position]}: trained {r[token_id]}, tagged "
        "{r[tagged_token_id]}); the POS tags were made with another tokenizer or max_target_length": differ,
    }.items():
        if bad.any():
            raise DataError(f"{source}: {int(bad.sum())} " + problem.format(t=tags_source, r=merged[bad].iloc[0]))
    words = merged[merged["word_index"].notna()].sort_values(keys, kind="stable")  # special tokens are no word
    grouped = words.groupby(["client", "round", "example_id", "word_index"], sort=True)
    kd = (
        grouped["kd_any"].mean() > 0.5
        if word_rule == "majority"
        else grouped["kd_any"].agg({"first": "first", "any": "max", "all": "min"}[word_rule])
    )
    return pd.DataFrame(
        {
            "kd": kd.astype(bool),
            "pos": grouped["pos"].first(),
            "is_noun_or_verb": grouped["is_noun_or_verb"].first().astype(bool),
            "n_tokens": grouped.size(),
        }
    ).reset_index()


def to_best(updates: pd.DataFrame, best_round: int) -> pd.DataFrame:
    """The word updates of rounds 1 .. ``best_round``: the window the KD usage ratio and the POS pattern cover."""
    return updates[(updates["round"] >= 1) & (updates["round"] <= best_round)]


def kd_usage(updates: pd.DataFrame, best_round: int) -> dict[str, Any]:
    """A client's KD usage over rounds 1..best_round, as kd_analysis.json's ``per_experiment`` records it."""
    window = to_best(updates, best_round)
    n, k = len(window), int(window["kd"].sum())
    return {
        "best_round": best_round,
        "kd_usage_ratio": k / n if n else math.nan,
        "kd_word_updates": k,
        "word_updates": n,
    }


def pos_distribution(updates: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Per POS: KD / non-KD word updates, the POS's KD rate and its share of all KD / non-KD updates."""
    counts = updates.groupby(["pos", "kd"]).size().unstack(fill_value=0).reindex(columns=[True, False], fill_value=0)
    n_kd, n_no = int(counts[True].sum()), int(counts[False].sum())
    return {
        str(pos): {
            "kd": kd,
            "no_kd": no,
            "kd_rate": kd / (kd + no),
            "share_of_kd": kd / n_kd if n_kd else math.nan,
            "share_of_no_kd": no / n_no if n_no else math.nan,
        }
        for pos, kd, no in counts.sort_values(by=[True, False], ascending=False).itertuples()
    }


def pos_summary(updates: pd.DataFrame) -> dict[str, float]:
    """The paper's two statements as numbers (NaN, the mean of no update, where a share has no updates)."""
    kd, noun_verb = updates["kd"], updates["is_noun_or_verb"]
    return {
        "noun_verb_kd_rate": float(kd[noun_verb].mean()),
        "noun_verb_share_of_kd": float(noun_verb[kd].mean()),
        "det_pron_share_of_no_kd": float(updates.loc[~kd, "pos"].isin(["DET", "PRON"]).mean()),
    }


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std; the std of one value is undefined (NaN, written as null), never 0."""
    arr = np.asarray(values, dtype=float)
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else math.nan


def client_summary(
    client: str, words: pd.DataFrame, gate: pd.DataFrame, per_seed: dict[str, dict[str, Any]], tau: float | None
) -> tuple[dict[str, Any], pd.DataFrame]:
    """One client's kd_analysis.json entry over the experiments (seeds) of ``per_seed`` (experiment -> its best round
    and KD usage ratio, Analysis.usage; ``words``, ``gate``: with an ``experiment`` column): the usage ratio's mean
    over seeds; POS pattern, distribution and gate statistics per round (fraction passing the gate, i.e. KD applied;
    median entropy) of the seeds' updates pooled (ratios of totals); and its token updates once per round, pooled."""
    window = pd.concat(
        [to_best(w, per_seed[n]["best_round"]) for n, w in words[words["client"] == client].groupby("experiment")]
    )
    ratio, ratio_std = mean_std([r["kd_usage_ratio"] for r in per_seed.values()])
    # entropy statistics over all logged rounds, pooled over seeds (one box per round); one row per token update
    # and round: local epochs repeat the round's (fixed-teacher) gate decision
    gate_c = gate[gate["client"] == client].drop_duplicates(["experiment", "round", "example_id", "position"])
    by_round = {int(r): (g["kd_applied"], g["entropy"].to_numpy(dtype=float)) for r, g in gate_c.groupby("round")}
    # tokens whose kd_applied disagrees with H(q_g) < tau (0 for a consistent log; None: tau is no entropy)
    kd, h = gate_c["kd_applied"].to_numpy(), gate_c["entropy"].to_numpy(dtype=float)
    record = {
        "experiments": sorted(per_seed),
        "kd_usage_ratio": ratio,
        "kd_usage_ratio_std": ratio_std,
        "paper_kd_usage_ratio": KD_USAGE_RATIO.get(client),
        "per_experiment": per_seed,
        **pos_summary(window),
        "paper_det_pron_share_of_no_kd": PAPER_DET_PRON_SHARE_OF_NON_KD,
        "pos": pos_distribution(window),
        "gate_pass_fraction_per_round": {r: float(applied.mean()) for r, (applied, _) in by_round.items()},
        "entropy_median_per_round": {r: float(np.quantile(e, 0.5)) for r, (_, e) in by_round.items()},
        "gate_inconsistent_tokens": int(((h < tau) != kd).sum()) if tau is not None else None,
    }
    return record, gate_c


def seed_means(runs: Sequence[tuple[str, dict[str, dict[str, float]] | None]]) -> dict[str, dict[str, Any]]:
    """Per client: mean and std over seeds of each metric, from (experiment, per-client scores or None) runs."""
    rows = [(name, client, *(s[m] for m in METRICS)) for name, scores in runs for client, s in (scores or {}).items()]
    return {
        client: {
            "n_seeds": len(g),
            "experiments": list(g["experiment"]),
            **{k: {m: mean_std(g[m])[i] for m in METRICS} for i, k in enumerate(("mean", "std"))},
        }
        for client, g in pd.DataFrame(rows, columns=["experiment", "client", *METRICS]).groupby("client", sort=False)
    }


# A sweep point: which run and client, its average ROUGE, its KD usage ratio and its POS pattern.
SWEEP_POS = ("noun_verb_kd_rate", "det_pron_share_of_no_kd")
SWEEP_COLUMNS = ["experiment", "client", "tau", "tau_scale", "seed", "avg_rouge", "kd_usage_ratio", *SWEEP_POS]


def gate_name(run: Experiment) -> str:
    """A SelectKD run's gate: the entropy gate's tau_scale (absolute: tau an entropy), else kd_gate (e.g. margin)."""
    return run.tau_scale if run.kd_gate == "entropy" else run.kd_gate


def tau_nats(run: Experiment) -> float | None:
    """A run's tau on the sweep's axis, in nats: an absolute threshold in bits is the same gate at tau x ln 2."""
    bits = (gate_name(run), run.entropy_log_base) == ("absolute", "2") and run.tau is not None
    return run.tau * math.log(2) if bits else run.tau


def tau_sweep_rows(run: Experiment, usage: dict[str, Any], scores: dict[str, dict[str, float]]) -> Iterator[tuple]:
    """One sweep point per client of one experiment (:data:`SWEEP_COLUMNS`): its ROUGE, KD usage ratio, POS pattern."""
    words = usage["words"]
    for client, s in scores.items():
        u = usage["clients"].get(client)
        # the POS pattern over the rounds up to the client's best one, as in the main-study analysis (NaN: no update)
        pos = pos_summary(to_best(words[words["client"] == client], u["best_round"] if u else 0))
        point = (run.name, client, tau_nats(run), gate_name(run), run.seed, s["avg_rouge"])
        yield (*point, u["kd_usage_ratio"] if u else math.nan, *(pos[k] for k in SWEEP_POS))


def tau_sweep_summary(per_run: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Means over seeds per (client, tau): the points on the tau axis (thresholds in nats, :func:`tau_nats`, without
    the tau_scale column) and the portable gates beside them."""
    summary = (
        per_run.groupby(["tau_scale", "client", "tau"])
        .agg(**{c: (c, "mean") for c in ("avg_rouge", "kd_usage_ratio", *SWEEP_POS)}, n_seeds=("seed", "nunique"))
        .reset_index()  # sorted by its keys (groupby's sort)
    )
    # Only thresholds in nats share an axis; the portable gates (a fraction of ln|V|, a quantile) are
    # reported beside them, never drawn on the same tau axis.
    table = summary[summary["tau_scale"] == "absolute"].drop(columns="tau_scale")
    return table, summary[summary["tau_scale"] != "absolute"]


def json_safe(obj: Any) -> Any:
    """JSON-safe: NaN -> None, floats rounded to 6 places (counts are ints already: int(), len(), pandas' boxing)."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return None if math.isnan(float(obj)) else round(float(obj), 6)
    return obj


def plot_pos(client: str, record: dict[str, Any], path: Path) -> None:
    """The POS distribution of a client's :func:`client_summary` record and its KD usage, ours and the paper's."""
    dist, ratio, paper_ratio = record["pos"], record["kd_usage_ratio"], record["paper_kd_usage_ratio"]
    tags = list(dist)
    x = np.arange(len(tags))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.bar(x - 0.2, [100 * dist[t]["share_of_kd"] for t in tags], 0.4, label="trained with KD")
    ax1.bar(x + 0.2, [100 * dist[t]["share_of_no_kd"] for t in tags], 0.4, label="trained without KD")
    ax1.set_xticks(x, tags, rotation=60)
    ax1.set(ylabel="% of word updates", title="POS distribution of words trained with / without KD")
    ax1.legend()
    ax2.bar(x, [100 * dist[t]["kd_rate"] for t in tags], 0.6, color="tab:green")
    ax2.axhline(100 * ratio, color="k", ls="--", lw=1, label=f"all words: {100 * ratio:.1f} %")
    if paper_ratio is not None:
        ax2.axhline(100 * paper_ratio, color="tab:red", ls=":", lw=1, label=f"paper: {100 * paper_ratio:.0f} %")
    ax2.set_xticks(x, tags, rotation=60)
    ax2.set(ylim=(0, 105), ylabel="% of the POS's word updates with KD", title="KD usage per POS")
    ax2.legend(loc="lower right")
    fig.suptitle(f"{client}: KD usage ratio {100 * ratio:.1f} % (rounds 1..best)")
    save(fig, path)


def plot_entropy(
    client: str, gate: pd.DataFrame, record: dict[str, Any], tau: float | None, unit: str, path: Path
) -> None:
    """H(q_g) per round of a client's pooled gate decisions, under the pass fractions and best rounds of its
    :func:`client_summary` record; ``unit``: H(q_g)'s and tau's, nats or bits."""
    rounds = sorted(gate["round"].unique())  # gate: one row per token update and round
    fig, (ax1, ax2) = plt.subplots(
        2, 1, figsize=(max(6, 0.6 * len(rounds) + 3), 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    data = [gate.loc[gate["round"] == r, "entropy"].to_numpy(dtype=float) for r in rounds]
    ax1.boxplot(data, positions=rounds, whis=(5, 95), showfliers=False, widths=0.6)
    if tau is not None:
        ax1.axhline(tau, color="tab:red", ls="--", label=f"tau = {tau:g} {unit}")
        ax1.legend()
    ax1.set_ylabel(f"H(q_g) ({unit})")
    ax1.set_title(f"{client}: H(q_g) per round (box 25-75 %, whiskers 5-95 %)", fontsize=10)
    passed = record["gate_pass_fraction_per_round"]
    ax2.bar(list(passed), [100 * f for f in passed.values()], color="tab:blue")
    best = [r["best_round"] for r in record["per_experiment"].values()]
    ax2.vlines(sorted(set(best)), 0, 1, transform=ax2.get_xaxis_transform(), color="k", ls=":", lw=1)
    ax2.set(ylim=(0, 100), ylabel="% tokens with KD", xticks=rounds, xlabel="round (dotted: best round)")
    save(fig, path)


def _client_panels(clients: list[str], width: float, height: float, empty_message: str):
    """A one-row figure and its ``width`` x ``height`` panels, one per client (none: one saying why it is empty)."""
    fig, axes = plt.subplots(1, max(1, len(clients)), figsize=(width * max(1, len(clients)), height), squeeze=False)
    if not clients:
        axes[0][0].text(0.5, 0.5, empty_message, ha="center", va="center")
        axes[0][0].set_axis_off()
    return fig, axes[0]


def plot_hardkd(comparison: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    clients = sorted({c for per in comparison.values() for c in per})
    fig, axes = _client_panels(clients, 4, 3.8, "no evaluated SelectKD / hard-KD experiments")
    labels = ["R-1", "R-2", "R-L", "avg"]
    x = np.arange(len(labels))
    for ax, client in zip(axes, clients):
        for j, (method, name) in enumerate(((SELECTKD, "SelectKD"), (HARDKD, "noun-verb hard KD"))):
            rec = comparison[method].get(client)
            if not rec:
                continue
            yerr = [rec["std"][m] for m in METRICS] if rec["n_seeds"] > 1 else None
            means = [rec["mean"][m] for m in METRICS]
            ax.bar(x + (j - 0.5) * 0.4, means, 0.4, yerr=yerr, label=f"{name} (n={rec['n_seeds']})")
        ax.set(xticks=x, xticklabels=labels, title=client, ylabel="ROUGE F1 x 100")
        ax.legend(fontsize=8)
    fig.suptitle("Noun-verb hard KD vs selective KD")
    save(fig, path)


def plot_tau_sweep(sweep: pd.DataFrame, tau_main: float | None, path: Path) -> None:
    clients = sorted(sweep["client"].unique()) if len(sweep) else []
    fig, axes = _client_panels(clients, 4.2, 3.6, "no tau-sweep experiments with results")
    for ax, client in zip(axes, clients):
        d = sweep[sweep["client"] == client].sort_values("tau")
        ax.plot(d["tau"], d["avg_rouge"], "o-", color="tab:blue", label="avg ROUGE")
        ax.set_ylabel("average ROUGE (R-1, R-2, R-L)", color="tab:blue")
        ax2 = ax.twinx()
        ax2.plot(d["tau"], 100 * d["kd_usage_ratio"], "s--", color="tab:orange", label="KD usage")
        ax2.set_ylabel("KD usage ratio (%)", color="tab:orange")
        ax2.set_ylim(0, 100)
        if tau_main is not None:
            ax.axvline(tau_main, color="grey", ls=":", lw=1)
        ax.set(xlabel="tau (nats)", title=client)
    dotted = " (dotted: main study)" if tau_main is not None and clients else ""  # what is drawn, only
    fig.suptitle(f"Entropy threshold tau{dotted}")
    save(fig, path)
