"""Stage ``analyze``: why selective KD works (METHOD.md section 7 items 6, 9, 10).

From the gate logs of the selective-KD experiments of the main study (``method: fedselectkd, study: main``):

- **KD usage ratio** per client = KD word updates / (rounds x target words), rounds 1 .. the client's best round
  (paper: 86 % Academic, 88 % Committee, 89 % Product). Sub-word tokens are first mapped to whitespace words
  (:mod:`pipeline.datasets.words`, via ``data/processed/postags.parquet``). One *word update* = one target word trained
  in one round; it is a **KD word update** when KD was applied to the word's tokens under ``analyze.word_rule``
  (default ``first``: KD on the word's first sub-word token - the step where the model chooses the word; the
  continuation pieces are nearly determined by it). Within a round the teacher (global adapter) is fixed, so
  local epochs repeat the same gate decision; a token trained in several epochs of a round counts once (KD if
  applied in any of them; disagreements are counted in the JSON). The paper's worked example: "project manager
  decides to use lcd" trained 2 rounds with 3 KD word updates -> 3 / (6 x 2) = 25 %. The denominator is the
  number of (word, round) pairs actually trained, which is rounds x words when every client trains every round.
- **POS distribution** (universal tags) of KD and non-KD word updates, per client (paper: nouns and verbs are
  nearly all KD words; determiners and pronouns are 74 % of non-KD words).
- **Gate statistics**: the distribution of H(q_g) per round with tau marked, and the fraction of tokens passing
  the gate (KD applied) per round.
- **Noun-verb hard KD** (``method: hardkd``) against SelectKD, ROUGE per client from the evaluation metrics.
- **tau sweep**: average ROUGE (mean of R-1, R-2, R-L) and KD usage ratio against tau per client, from the
  ``study: tau_sweep`` experiments plus the main SelectKD at the top-level tau.

Experiments listed in params.yaml whose files are missing are reported in the JSON (``missing``) and left out;
no number is invented. Every number is a mean over the seeds available (per-seed values are kept).

Outputs: ``reports/analysis/kd_analysis.json`` (DVC metric), ``reports/analysis/tau_sweep.csv`` (DVC plot) and
``reports/analysis/figures/`` (DVC plots directory): ``pos_<client>.png``, ``entropy_<client>.png``,
``hardkd_vs_selectkd.png``, ``tau_sweep.png``.

    python -m pipeline.analyze [--params params.yaml] [--out reports/analysis]
"""
from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from pipeline.common import atomic  # noqa: E402
from pipeline.common.config import from_dict, load_params  # noqa: E402
from pipeline.results.published import KD_USAGE_RATIO  # noqa: E402
from pipeline.common.schema import DataError  # noqa: E402
from pipeline.common.timing import stage_timer

MODELS_DIR = Path("models")
TRAIN_REPORTS = Path("reports/train")
EVAL_DIR = Path("reports/eval")
POSTAGS = Path("data/processed/postags.parquet")
OUT_DIR = Path("reports/analysis")

GATE_COLUMNS = ["client", "round", "example_id", "position", "token_id", "entropy", "kd_applied"]
WORD_RULES = ("first", "any", "all", "majority")
SELECTKD, HARDKD = "fedselectkd", "hardkd"
MAIN_STUDY, TAU_STUDY = "main", "tau_sweep"
TABLE_METRICS = ("rouge1", "rouge2", "rougeLsum", "avg_rouge")  # rougeLsum = the tables' ROUGE-L (scoring.py)
# Section 7.9: determiners and pronouns are 74 % of the words trained without KD.
PAPER_DET_PRON_SHARE_OF_NON_KD = 0.74


@dataclass
class AnalyzeConfig:
    word_rule: str = "first"

    def __post_init__(self) -> None:
        if self.word_rule not in WORD_RULES:
            raise ValueError(f"analyze.word_rule: {self.word_rule!r} is not one of {WORD_RULES}")


@dataclass
class Experiment:
    name: str
    method: str
    study: str
    partition: str
    seed: int
    tau: float | None
    tau_scale: str = "absolute"  # how the gate reads tau (pipeline.modeling.losses.TAU_SCALES)


@dataclass
class Missing:
    """Input files of listed experiments that do not exist (yet): reported, never replaced by numbers."""

    _needed: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    def add(self, experiment: str, path: Path, needed_for: str) -> None:
        uses = self._needed.setdefault((experiment, str(path)), [])
        if needed_for not in uses:
            uses.append(needed_for)

    @property
    def items(self) -> list[dict[str, str]]:
        return [{"experiment": e, "file": f, "needed_for": ", ".join(u)} for (e, f), u in sorted(self._needed.items())]


# ----------------------------------------------------------------------------------------------------------------
# Inputs


def experiments_from_params(params: dict[str, Any]) -> list[Experiment]:
    """The experiments of params.yaml, tau resolved as the plan stage resolves it (entry tau, else top-level)."""
    out = []
    for name, raw in (params.get("experiments") or {}).items():
        if not isinstance(raw, dict) or "method" not in raw or "partition" not in raw:
            raise ValueError(f"params.yaml experiments.{name}: needs at least 'method' and 'partition'")
        tau = raw.get("tau", params.get("tau") if raw["method"] == SELECTKD else None)
        tau_scale = raw.get("tau_scale", (params.get("train") or {}).get("tau_scale", "absolute"))
        out.append(Experiment(str(name), str(raw["method"]), str(raw.get("study", MAIN_STUDY)),
                              str(raw["partition"]), int(raw.get("seed", 0)),
                              None if tau is None else float(tau), str(tau_scale)))
    return out


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: invalid JSON ({err})") from None


def read_gate_log(path: Path) -> pd.DataFrame:
    gate = pd.read_parquet(path)
    missing = sorted(set(GATE_COLUMNS) - set(gate.columns))
    if missing:
        raise DataError(f"{path}: gate log lacks column(s) {missing} (has {list(gate.columns)})")
    gate = gate[GATE_COLUMNS].copy()
    gate["example_id"] = gate["example_id"].astype(str)
    gate["client"] = gate["client"].astype(str)
    gate["kd_applied"] = gate["kd_applied"].astype(bool)
    return gate


def best_rounds(metrics: dict[str, Any], path: Path) -> dict[str, int]:
    """Per client best round from the train stage's metrics.json (``clients.<client>.best_round``)."""
    clients = metrics.get("clients")
    if not isinstance(clients, dict) or not clients:
        raise DataError(f"{path}: no 'clients' mapping with per-client best rounds")
    out = {}
    for client, rec in clients.items():
        if not isinstance(rec, dict) or rec.get("best_round") is None:
            raise DataError(f"{path}: client {client!r} has no 'best_round'")
        out[str(client)] = int(rec["best_round"])
    return out


def eval_scores(metrics: dict[str, Any], path: Path) -> dict[str, dict[str, float]]:
    """Per client ROUGE (the tables' metrics) from the evaluate stage's metrics.json."""
    clients = metrics.get("clients")
    if not isinstance(clients, dict) or not clients:
        raise DataError(f"{path}: no 'clients' mapping of ROUGE scores")
    out = {}
    for client, rec in clients.items():
        lacking = [m for m in TABLE_METRICS if m not in rec]
        if lacking:
            raise DataError(f"{path}: client {client!r} lacks {lacking}")
        out[str(client)] = {m: float(rec[m]) for m in TABLE_METRICS}
    return out


# ----------------------------------------------------------------------------------------------------------------
# Word updates and the KD usage ratio


@dataclass
class WordUpdates:
    """One row per (client, round, example_id, word_index): the word's POS and whether its update used KD."""

    table: pd.DataFrame
    tokens: int  # distinct (client, round, example, position) token updates in the log
    tokens_without_word: int  # special / whitespace-only tokens, not words
    epoch_disagreements: int  # tokens whose KD decision differed between epochs of one round


def word_updates(gate: pd.DataFrame, postags: pd.DataFrame, word_rule: str = "first",
                 source: str = "gate log") -> WordUpdates:
    """Collapse token gate decisions to word updates (see the module docstring for the definition)."""
    if word_rule not in WORD_RULES:
        raise ValueError(f"word_rule {word_rule!r} is not one of {WORD_RULES}")
    keys = ["client", "round", "example_id", "position"]
    per_token = gate.groupby(keys, sort=False).agg(
        token_id=("token_id", "first"), kd_any=("kd_applied", "max"), kd_all=("kd_applied", "min")
    ).reset_index()
    disagreements = int((per_token["kd_any"] != per_token["kd_all"]).sum())
    tags = postags[["example_id", "position", "token_id", "word_index", "pos", "is_noun_or_verb"]].rename(
        columns={"token_id": "tagged_token_id"})
    merged = per_token.merge(tags, on=["example_id", "position"], how="left", validate="many_to_one")
    untagged = merged["tagged_token_id"].isna()
    if untagged.any():
        row = merged[untagged].iloc[0]
        raise DataError(
            f"{source}: {int(untagged.sum())} trained tokens have no POS tag in {POSTAGS} (e.g. example "
            f"{row['example_id']} position {row['position']}); re-run the postag stage over these examples")
    differ = merged["tagged_token_id"].astype(np.int64) != merged["token_id"].astype(np.int64)
    if differ.any():
        row = merged[differ].iloc[0]
        raise DataError(
            f"{source}: {int(differ.sum())} tokens differ from {POSTAGS} (e.g. example {row['example_id']} "
            f"position {row['position']}: trained {row['token_id']}, tagged {row['tagged_token_id']}); the "
            f"POS tags were made with another tokenizer or max_target_length")
    no_word = merged["word_index"].isna()
    words = merged[~no_word].sort_values(keys, kind="stable")
    grouped = words.groupby(["client", "round", "example_id", "word_index"], sort=True)
    if word_rule == "first":
        kd = grouped["kd_any"].first()
    elif word_rule == "any":
        kd = grouped["kd_any"].max()
    elif word_rule == "all":
        kd = grouped["kd_any"].min()
    else:
        kd = grouped["kd_any"].mean() > 0.5
    table = pd.DataFrame({
        "kd": kd.astype(bool),
        "pos": grouped["pos"].first(),
        "is_noun_or_verb": grouped["is_noun_or_verb"].first().astype(bool),
        "n_tokens": grouped.size(),
    }).reset_index()
    return WordUpdates(table, len(per_token), int(no_word.sum()), disagreements)


def kd_usage_ratio(updates: pd.DataFrame, best_round: int, first_round: int = 1) -> tuple[float, int, int]:
    """(KD word updates / word updates, KD word updates, word updates) over rounds first_round..best_round."""
    window = updates[(updates["round"] >= first_round) & (updates["round"] <= best_round)]
    n = len(window)
    k = int(window["kd"].sum())
    return (k / n if n else math.nan), k, n


def pos_distribution(updates: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Per POS: KD / non-KD word updates, the POS's KD rate and its share of all KD / non-KD updates."""
    counts = updates.groupby(["pos", "kd"]).size().unstack(fill_value=0)
    for col in (True, False):
        if col not in counts.columns:
            counts[col] = 0
    n_kd, n_no = int(counts[True].sum()), int(counts[False].sum())
    out = {}
    for pos, row in counts.sort_values(by=[True, False], ascending=False).iterrows():
        kd, no = int(row[True]), int(row[False])
        out[str(pos)] = {
            "kd": kd,
            "no_kd": no,
            "kd_rate": kd / (kd + no),
            "share_of_kd": kd / n_kd if n_kd else math.nan,
            "share_of_no_kd": no / n_no if n_no else math.nan,
        }
    return out


def pos_summary(updates: pd.DataFrame) -> dict[str, float]:
    """The paper's two statements as numbers."""
    nv = updates[updates["is_noun_or_verb"]]
    no_kd = updates[~updates["kd"]]
    return {
        "noun_verb_kd_rate": float(nv["kd"].mean()) if len(nv) else math.nan,
        "noun_verb_share_of_kd": float(updates.loc[updates["kd"], "is_noun_or_verb"].mean())
        if updates["kd"].any() else math.nan,
        "det_pron_share_of_no_kd": float(no_kd["pos"].isin(["DET", "PRON"]).mean()) if len(no_kd) else math.nan,
    }


def gate_once(gate: pd.DataFrame, keys: Sequence[str] = ("client", "round", "example_id", "position")) -> pd.DataFrame:
    """One row per token update per round: local epochs repeat the round's (fixed-teacher) gate decision."""
    return gate.drop_duplicates(list(keys))


def gate_per_round(gate: pd.DataFrame, tau: float | None) -> pd.DataFrame:
    """Per round (rows of one client, already :func:`gate_once`): tokens, fraction passing the gate (KD applied),
    entropy quantiles, and how often ``kd_applied`` disagrees with ``H(q_g) < tau`` (0 for a consistent log)."""
    rows = []
    for rnd, g in gate.groupby("round"):
        h = g["entropy"].to_numpy(dtype=float)
        rows.append({
            "round": int(rnd), "tokens": len(g), "pass_fraction": float(g["kd_applied"].mean()),
            **{f"entropy_q{q}": float(np.quantile(h, q / 100)) for q in (5, 25, 50, 75, 95)},
            "entropy_mean": float(h.mean()),
            "gate_inconsistent": int(((h < tau) != g["kd_applied"].to_numpy()).sum()) if tau is not None else 0,
        })
    return pd.DataFrame(rows, columns=["round", "tokens", "pass_fraction", "entropy_q5", "entropy_q25",
                                       "entropy_q50", "entropy_q75", "entropy_q95", "entropy_mean",
                                       "gate_inconsistent"])


# ----------------------------------------------------------------------------------------------------------------
# Figures


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
    fig.tight_layout()
    atomic.savefig(fig, path, dpi=120)
    plt.close(fig)


def plot_entropy(client: str, gate: pd.DataFrame, stats: pd.DataFrame, tau: float | None,
                 best: list[int], path: Path) -> None:
    once = gate  # already one row per token update per round
    rounds = sorted(once["round"].unique())
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, 0.6 * len(rounds) + 3), 6), sharex=True,
                                   gridspec_kw={"height_ratios": [2, 1]})
    data = [once.loc[once["round"] == r, "entropy"].to_numpy(dtype=float) for r in rounds]
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
    fig.tight_layout()
    atomic.savefig(fig, path, dpi=120)
    plt.close(fig)


def _finish_client_panels(fig, axes, clients: list[str], empty_message: str, title: str, path: Path) -> None:
    """Title and save a one-row figure of per-client panels; with no client, say why the figure is empty."""
    if not clients:
        axes[0][0].text(0.5, 0.5, empty_message, ha="center", va="center")
        axes[0][0].set_axis_off()
    fig.suptitle(title)
    fig.tight_layout()
    atomic.savefig(fig, path, dpi=120)
    plt.close(fig)


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
            means = [rec["mean"][m] for m in TABLE_METRICS]
            stds = [rec["std"][m] for m in TABLE_METRICS]
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


# ----------------------------------------------------------------------------------------------------------------
# The stage


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std; the std of one value is undefined (NaN, written as null), never 0."""
    arr = np.asarray(values, dtype=float)
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else math.nan


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN -> None, numpy scalars -> Python."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return None if math.isnan(float(obj)) else round(float(obj), 6)
    return obj


@dataclass
class Paths:
    models: Path = MODELS_DIR
    train_reports: Path = TRAIN_REPORTS
    eval: Path = EVAL_DIR
    postags: Path = POSTAGS
    out: Path = OUT_DIR

    def gate_log(self, exp: str) -> Path:
        return self.models / exp / "gate_log.parquet"

    def train_metrics(self, exp: str) -> Path:
        return self.train_reports / exp / "metrics.json"

    def eval_metrics(self, exp: str) -> Path:
        return self.eval / exp / "metrics.json"


class Analysis:
    def __init__(self, cfg: AnalyzeConfig, experiments: list[Experiment], tau: float | None, paths: Paths) -> None:
        self.cfg, self.experiments, self.tau, self.paths = cfg, experiments, tau, paths
        self.missing = Missing()
        self._postags: pd.DataFrame | None = None

    @property
    def postags(self) -> pd.DataFrame:
        if self._postags is None:
            if not self.paths.postags.exists():
                raise FileNotFoundError(f"{self.paths.postags}: POS tags not found (run `dvc repro postag`)")
            self._postags = pd.read_parquet(self.paths.postags)
            self._postags["example_id"] = self._postags["example_id"].astype(str)
        return self._postags

    def usage(self, exp: Experiment, needed_for: str) -> dict[str, Any] | None:
        """Word updates + per client best round and KD usage ratio of one experiment, or None if files are missing."""
        gate_path, train_path = self.paths.gate_log(exp.name), self.paths.train_metrics(exp.name)
        absent = [p for p in (gate_path, train_path) if not p.exists()]
        for p in absent:
            self.missing.add(exp.name, p, needed_for)
        if absent:
            return None
        gate = read_gate_log(gate_path)
        best = best_rounds(read_json(train_path), train_path)
        wu = word_updates(gate, self.postags, self.cfg.word_rule, str(gate_path))
        per_client = {}
        for client, upd in wu.table.groupby("client"):
            if client not in best:
                raise DataError(f"{train_path}: no best round for client {client!r} of {gate_path}")
            ratio, k, n = kd_usage_ratio(upd, best[client])
            per_client[client] = {"best_round": best[client], "kd_usage_ratio": ratio, "kd_word_updates": k,
                                  "word_updates": n}
        return {"gate": gate, "words": wu, "clients": per_client}

    def scores(self, exp: Experiment, needed_for: str) -> dict[str, dict[str, float]] | None:
        path = self.paths.eval_metrics(exp.name)
        if not path.exists():
            self.missing.add(exp.name, path, needed_for)
            return None
        return eval_scores(read_json(path), path)

    def main_study(self, figures: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """Usage ratio, POS distribution and gate statistics per client; also returns per-experiment usage."""
        main = [e for e in self.experiments if e.method == SELECTKD and e.study == MAIN_STUDY]
        usages = {e.name: u for e in main if (u := self.usage(e, "KD usage / POS analysis")) is not None}
        clients: dict[str, Any] = {}
        if not usages:
            return clients, usages
        all_words = pd.concat([u["words"].table.assign(experiment=n) for n, u in usages.items()])
        all_gate = pd.concat([u["gate"].assign(experiment=n) for n, u in usages.items()])
        taus = sorted({e.tau for e in main if e.name in usages and e.tau is not None})
        if len(taus) > 1:
            raise ValueError(f"params.yaml: the main-study SelectKD experiments use different tau values {taus}")
        tau = taus[0] if taus else None
        for client in sorted(all_words["client"].unique()):
            per_seed = {n: u["clients"][client] for n, u in usages.items() if client in u["clients"]}
            windows = [w[(w["round"] >= 1) & (w["round"] <= per_seed[n]["best_round"])]
                       for n, w in all_words[all_words["client"] == client].groupby("experiment")]
            window = pd.concat(windows)
            ratio, ratio_std = _mean_std([r["kd_usage_ratio"] for r in per_seed.values()])
            dist = pos_distribution(window)
            # entropy statistics over all logged rounds, pooled over seeds (one box per round)
            gate_c = gate_once(all_gate[all_gate["client"] == client],
                               ("experiment", "round", "example_id", "position"))
            stats = gate_per_round(gate_c, tau)
            paper = KD_USAGE_RATIO.get(client)
            clients[client] = {
                "experiments": sorted(per_seed),
                "kd_usage_ratio": ratio,
                "kd_usage_ratio_std": ratio_std,
                "paper_kd_usage_ratio": paper,
                "per_experiment": per_seed,
                **pos_summary(window),
                "paper_det_pron_share_of_no_kd": PAPER_DET_PRON_SHARE_OF_NON_KD,
                "pos": dist,
                "gate_pass_fraction_per_round": {int(r): float(f) for r, f in zip(stats["round"], stats["pass_fraction"])},
                "entropy_median_per_round": {int(r): float(f) for r, f in zip(stats["round"], stats["entropy_q50"])},
                "gate_inconsistent_tokens": int(stats["gate_inconsistent"].sum()),
            }
            plot_pos(client, dist, ratio, paper, figures / f"pos_{safe_name(client)}.png")
            plot_entropy(client, gate_c, stats, tau, [r["best_round"] for r in per_seed.values()],
                         figures / f"entropy_{safe_name(client)}.png")
        return clients, usages

    def hardkd(self, figures: Path) -> dict[str, Any]:
        """ROUGE of noun-verb hard KD vs SelectKD (main study) per client, mean and std over seeds."""
        main_parts = {e.partition for e in self.experiments if e.method == SELECTKD and e.study == MAIN_STUDY}
        groups = {
            SELECTKD: [e for e in self.experiments if e.method == SELECTKD and e.study == MAIN_STUDY],
            HARDKD: [e for e in self.experiments if e.method == HARDKD and (not main_parts or e.partition in main_parts)],
        }
        comparison: dict[str, dict[str, dict[str, Any]]] = {}
        for method, exps in groups.items():
            per_client: dict[str, list[dict[str, float]]] = {}
            names: dict[str, list[str]] = {}
            for e in exps:
                sc = self.scores(e, "hard KD vs SelectKD")
                for client, s in (sc or {}).items():
                    per_client.setdefault(client, []).append(s)
                    names.setdefault(client, []).append(e.name)
            comparison[method] = {
                client: {"n_seeds": len(v), "experiments": names[client],
                         "mean": {m: _mean_std([s[m] for s in v])[0] for m in TABLE_METRICS},
                         "std": {m: _mean_std([s[m] for s in v])[1] for m in TABLE_METRICS}}
                for client, v in per_client.items()}
        plot_hardkd(comparison, figures / "hardkd_vs_selectkd.png")
        delta = {c: comparison[HARDKD][c]["mean"]["avg_rouge"] - comparison[SELECTKD][c]["mean"]["avg_rouge"]
                 for c in comparison[HARDKD] if c in comparison[SELECTKD]}
        return {"methods": comparison, "hardkd_minus_selectkd_avg_rouge": delta}

    def tau_sweep(self, usages: dict[str, dict[str, Any]], figures: Path, csv_path: Path) -> dict[str, Any]:
        sweep = [e for e in self.experiments if e.study == TAU_STUDY]
        sweep_parts = {e.partition.split("/seed")[0] for e in sweep}
        # The main SelectKD is the sweep's point at the top-level tau - only when there is a sweep to join.
        main = [e for e in self.experiments if e.method == SELECTKD and e.study == MAIN_STUDY
                and e.partition.split("/seed")[0] in sweep_parts]
        rows = []
        for e in sweep + main:
            if e.tau is None:
                raise ValueError(f"params.yaml experiments.{e.name}: a tau-sweep experiment needs a tau")
            usage = usages.get(e.name) or self.usage(e, "tau sweep")
            scores = self.scores(e, "tau sweep")
            if usage is None or scores is None:
                continue
            words = usage["words"].table
            for client, s in scores.items():
                u = usage["clients"].get(client)
                # the POS pattern over the rounds up to the client's best one, as in the main-study analysis
                w = words[(words["client"] == client) & (words["round"] >= 1)
                          & (words["round"] <= (u["best_round"] if u else 0))]
                pos = pos_summary(w) if len(w) else {}
                rows.append({"experiment": e.name, "client": client, "tau": e.tau, "tau_scale": e.tau_scale,
                             "seed": e.seed,
                             "avg_rouge": s["avg_rouge"], "rouge1": s["rouge1"], "rouge2": s["rouge2"],
                             "rougeLsum": s["rougeLsum"],
                             "kd_usage_ratio": u["kd_usage_ratio"] if u else math.nan,
                             "noun_verb_kd_rate": pos.get("noun_verb_kd_rate", math.nan),
                             "det_pron_share_of_no_kd": pos.get("det_pron_share_of_no_kd", math.nan)})
        per_run = pd.DataFrame(rows, columns=["experiment", "client", "tau", "tau_scale", "seed", "avg_rouge", "rouge1",
                                              "rouge2", "rougeLsum", "kd_usage_ratio", "noun_verb_kd_rate",
                                              "det_pron_share_of_no_kd"])
        summary = (per_run.groupby(["tau_scale", "client", "tau"])
                   .agg(avg_rouge=("avg_rouge", "mean"), kd_usage_ratio=("kd_usage_ratio", "mean"),
                        noun_verb_kd_rate=("noun_verb_kd_rate", "mean"),
                        det_pron_share_of_no_kd=("det_pron_share_of_no_kd", "mean"), n_seeds=("seed", "nunique"))
                   .reset_index().sort_values(["tau_scale", "client", "tau"]))
        # Only thresholds in nats (or bits) share an axis; the portable gates (a fraction of ln|V|, a quantile) are
        # reported beside them, never drawn on the same tau axis.
        table = summary[summary["tau_scale"] == "absolute"].drop(columns="tau_scale")
        atomic.to_csv(table.round(6), csv_path, index=False)
        plot_tau_sweep(table, self.tau, figures / "tau_sweep.png")
        portable = summary[summary["tau_scale"] != "absolute"]
        return {"points": table.to_dict(orient="records"), "portable_gates": portable.to_dict(orient="records"),
                "experiments": sorted(per_run["experiment"].unique())}

    def run(self) -> dict[str, Any]:
        out = self.paths.out
        figures = out / "figures"
        figures.mkdir(parents=True, exist_ok=True)
        for old in figures.glob("*.png"):  # the stage owns this directory: no stale figures of removed clients
            old.unlink()
        clients, usages = self.main_study(figures)
        result = {
            "word_rule": self.cfg.word_rule,
            "tau": self.tau,
            "paper": {"kd_usage_ratio": KD_USAGE_RATIO, "det_pron_share_of_no_kd": PAPER_DET_PRON_SHARE_OF_NON_KD,
                      "noun_verb": "nearly all noun and verb words are trained with KD"},
            "clients": clients,
            "hardkd_vs_selectkd": self.hardkd(figures),
            "tau_sweep": self.tau_sweep(usages, figures, out / "tau_sweep.csv"),
            "missing": self.missing.items,
            "n_missing": len(self.missing.items),
        }
        result = _clean(result)
        atomic.write_json(out / "kd_analysis.json", result)
        return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    args = ap.parse_args(argv)
    with stage_timer("analyze"):  # wall time, peak RSS -> reports/timing/
        params = load_params(args.params)
        cfg = from_dict(AnalyzeConfig, params.get("analyze"), "analyze")
        analysis = Analysis(cfg, experiments_from_params(params), params.get("tau"), Paths(out=args.out))
        result = analysis.run()
        for client, rec in result["clients"].items():
            paper = rec["paper_kd_usage_ratio"]
            print(f"analyze: {client}: KD usage {100 * rec['kd_usage_ratio']:.1f} %"
                  + (f" (paper {100 * paper:.0f} %)" if paper is not None else ""))
        if result["missing"]:
            print(f"analyze: {result['n_missing']} input file(s) missing, left out (listed in kd_analysis.json):")
            for m in result["missing"]:
                print(f"  {m['experiment']}: {m['file']} ({m['needed_for']})")


if __name__ == "__main__":
    from pipeline.common.cli import run as run_cli

    raise SystemExit(run_cli(main))
