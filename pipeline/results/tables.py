"""The report's inputs (:class:`ReportInputs`), its record of what it wrote (:class:`Made`) and its tables: scores
averaged over seeds, the main table beside the published numbers (Table III layout), one table per study with its paired
comparisons, and the stage times."""

from __future__ import annotations

import functools
import json
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.common import atomic
from pipeline.common.config import PositiveInt, config
from pipeline.common.schema import QMSUM_DOMAINS, DataError
from pipeline.experiments.entries import Experiment, with_labels
from pipeline.results import comparisons, published
from pipeline.results.readers import GROUP_COLS, MARK, METRICS, convergence_note, row_mark
from pipeline.results.scoring import TABLE_METRICS, TABLE_ROUGE_L
from pipeline.results.stats import BootstrapConfig

METRIC_LABELS = {"rouge1": "R-1", "rouge2": "R-2", TABLE_ROUGE_L: "R-L", "avg_rouge": "avg"}
# The main table's columns (Table III long form), the order of its rows' values.
MAIN_COLUMNS = (
    "backbone method label paper_name client metric ours_mean ours_std n_seeds seeds missing_seeds paper diff"
).split()


@config
class ReportConfig:
    expected_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    case_study_seed: int = 0
    human_eval_per_domain: int = published.HUMAN_EVAL_MEETINGS_PER_DOMAIN
    human_eval_seed: int = 0
    human_eval_target: str = "fedselectkd"
    baselines: list[str] = field(default_factory=lambda: ["single", "fedavg", "fedkd"])
    # A smoke run (the default CPU profile) states its differences as numbers and draws no claim from them; a
    # study draws claims only from main-study comparisons with at least these seeds and test examples.
    smoke: bool = True
    claim_min_seeds: PositiveInt = 3
    claim_min_examples: PositiveInt = 100


@dataclass(frozen=True)
class ReportInputs:
    """What the report reads of a params file (the stage's, or a study folder's; pipeline/report.py reads it)."""

    planned: list[Experiment]
    cfg: ReportConfig = field(default_factory=ReportConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    # the plan's `train` of each AdaCentralized and AdaSingle experiment (its step budget, for the claims)
    train: dict[str, dict[str, Any]] = field(default_factory=dict)

    @functools.cached_property
    def labels(self) -> dict[str, str]:
        return with_labels(self.planned)

    @functools.cached_property
    def configurations(self) -> list[comparisons.Config]:
        return comparisons.configurations(self.planned, self.labels)


@dataclass
class Made:
    """What was written, by kind, and what was not, with why: the index of reports/README.md."""

    files: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    not_made: dict[str, str] = field(default_factory=dict)

    def text(self, kind: str, path: Path, text: str) -> None:
        atomic.write_text(path, text)
        self.files[kind].append(str(path))

    def csv(self, kind: str, path: Path, frame: pd.DataFrame) -> None:
        atomic.to_csv(frame, path, index=False)
        self.files[kind].append(str(path))


def _client_order(clients: Iterable[str]) -> list[str]:
    """QMSum's clients in the paper's order, then any other client sorted."""
    present = set(clients)
    return [c for c in QMSUM_DOMAINS if c in present] + sorted(present - set(QMSUM_DOMAINS))


def aggregate(scores: pd.DataFrame, inp: ReportInputs) -> pd.DataFrame:
    """Mean and sample std over seeds per (configuration, backbone, client), with the seeds present and missing
    (expected: `report.expected_seeds` plus any seed the `experiments` params plan for the configuration)."""
    expected = set(inp.cfg.expected_seeds)
    planned_seeds = {(c.study, c.label): {s for s, _ in c.runs} for c in inp.configurations}
    keys = [*GROUP_COLS, "backbone", "client"]
    columns = [*keys, *(f"{m}_{x}" for m in METRICS for x in ("mean", "std")), "n_seeds", "seeds", "missing_seeds"]
    out_rows = []
    for key, grp in scores.groupby(keys, dropna=False, sort=False):
        rec = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in zip(keys, key)}
        seeds = sorted(int(s) for s in grp["seed"])
        missing = (expected | planned_seeds.get((rec["study"], rec["label"]), set())) - set(seeds)
        # the mean and the sample std (ddof 1: NaN for one seed, whose spread is unknown, not 0)
        rec |= {f"{m}_{x}": float(grp[m].agg(x)) for m in METRICS for x in ("mean", "std")}
        rec |= {"n_seeds": len(seeds), "seeds": ",".join(map(str, seeds))}
        out_rows.append(rec | {"missing_seeds": ",".join(map(str, sorted(missing)))})
    return pd.DataFrame(out_rows, columns=columns)


def fmt(mean: float, std: float, n: int) -> str:
    """'27.09 ± 0.31', or '27.09 (n=1)': one seed has no spread, so none is shown (never '± 0.00')."""
    if pd.isna(mean):
        return "missing"
    if int(n) == 1:
        return f"{mean:.2f} (n=1)"
    return f"{mean:.2f}" + ("" if pd.isna(std) else f" ± {std:.2f}")


def main_table(agg: pd.DataFrame, backbone: str, inp: ReportInputs) -> pd.DataFrame:
    """Table III long form: method x client x metric, ours beside the paper's and the difference; a planned
    configuration without any evaluation gets its rows too (every seed missing), so no method hides silently."""
    paper = published.MAIN_TABLE.get(published.backbone_key(backbone) or "", {})
    sub = agg[(agg["study"] == "main") & (agg["backbone"] == backbone)]
    absent = [  # a planned configuration without any evaluation: each client's row, its scores NaN
        {"method": c.method, "label": c.label, "client": client, "n_seeds": 0, "seeds": ""}
        | {"missing_seeds": ",".join(map(str, sorted({s for s, _ in c.runs} | set(inp.cfg.expected_seeds))))}
        for c in inp.configurations
        if c.study == "main" and c.label not in set(sub["label"])
        for client in QMSUM_DOMAINS
    ]
    rows = []
    # the sort below puts the configurations in the paper's method order
    for (method, label), lsub in pd.concat([sub, pd.DataFrame(absent)]).groupby(["method", "label"], sort=True):
        name = published.PAPER_METHOD_NAMES.get(method, method)
        for client in _client_order(lsub["client"]):
            ours = lsub[lsub["client"] == client].iloc[0]
            pub = paper.get(client, {}).get(method)
            seeds = [ours[k] for k in ("n_seeds", "seeds", "missing_seeds")]
            for metric in TABLE_METRICS:
                p = getattr(pub, metric) if pub else None
                mean = ours[f"{metric}_mean"]
                row = (backbone, method, label, name, client, METRIC_LABELS[metric], mean, ours[f"{metric}_std"])
                rows.append((*row, *seeds, p, None if p is None else mean - p))
    # never empty: the report asks only for a backbone with main-study rows
    table = pd.DataFrame(rows, columns=MAIN_COLUMNS)
    order = {m: i for i, m in enumerate(published.METHOD_ORDER)}
    table["_order"] = [order.get(m, len(order)) for m in table["method"]]
    return table.sort_values(["_order", "label"], kind="stable").drop(columns="_order").reset_index(drop=True)


def main_table_markdown(
    table: pd.DataFrame, backbone: str, compared: pd.DataFrame, bootstrap: BootstrapConfig, converged: pd.DataFrame
) -> str:
    """Rows: method (ours / paper / difference); columns: client x R-1, R-2, R-L (the paper's Table III)."""
    key = published.backbone_key(backbone)
    clients = _client_order(table["client"])
    metrics = ["R-1", "R-2", "R-L"]
    header = ["Method", "", *[f"{c} {m}" for c in clients for m in metrics], "seeds"]
    lines = [
        f"# Main results, backbone `{backbone}`",
        "",
        "ROUGE F1 x 100, mean ± sample std over seeds ((n=1): one seed, no spread); R-L = rouge-score "
        f"`{TABLE_ROUGE_L}` (LCS of the whole summary, Porter stemming; its R-L / R-1 ratios match the paper's, "
        "`rougeLsum`'s do not: pipeline/results/scoring.py). "
        + (
            f"Paper: Feng et al. Table III, {key}."
            if key
            else "The paper reports no numbers for this backbone (BART-large, BART-base and LED-large only), "
            "so only ours are shown."
        ),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    # each (client, metric)'s cells as printed: ours, the paper's and ours − paper ('–' where the paper has none)
    printed = table.assign(
        ours=[fmt(*r) for r in zip(table["ours_mean"], table["ours_std"], table["n_seeds"])],
        paper=["–" if pd.isna(p) else f"{p:.2f}" for p in table["paper"]],
        diff=["–" if pd.isna(d) else f"{d:+.2f}" for d in table["diff"]],
    )
    grid = pd.MultiIndex.from_product([clients, metrics])  # a client's metric without a row: 'missing'
    for label, t in printed.groupby("label", sort=False):
        cells = (
            t.drop_duplicates(["client", "metric"]).set_index(["client", "metric"]).reindex(grid, fill_value="missing")
        )
        row, mark = t.iloc[0], row_mark(converged, "main", label, None)  # the row's seeds, method and its paper name
        seed_text = f"{row['n_seeds']}" + (f" ({row['seeds']})" if row["seeds"] else "")
        seed_text += f", missing {row['missing_seeds']}" if row["missing_seeds"] else ""
        seed_text += f" {mark}" if mark else ""
        name = row["paper_name"] + ("" if label == row["method"] else f" ({label})")
        rows = [(name, "ours", "ours", seed_text)] + (
            [("", "paper", "paper", ""), ("", "ours − paper", "diff", "")] if key else []
        )
        for first, kind, what, last in rows:
            lines.append("| " + " | ".join([first, kind, *cells[what], last]) + " |")
    if budget := convergence_note(converged, ["main"], set(table["label"])):
        lines += ["", budget + f" ({MARK} k/n after the seeds: client-runs of that method.)"]
    lines.append(comparisons.markdown_section(compared, "main", bootstrap))
    return "\n".join(lines) + "\n"


def study_table_markdown(
    agg: pd.DataFrame, study: str, compared: pd.DataFrame, bootstrap: BootstrapConfig, converged: pd.DataFrame | None
) -> str:
    sub = agg[agg["study"] == study]
    lines = [
        f"# Study `{study}`",
        "",
        f"ROUGE F1 x 100 per client, mean ± sample std over seeds ((n=1): one seed, no spread; R-L = "
        f'`{TABLE_ROUGE_L}`; avg = mean of R-1, R-2, R-L). "significantly vs": the baselines whose avg this '
        f"configuration is above (>) or below (<) at Holm p < {1 - bootstrap.level:.2g} (section below). "
        f'"best round last": {MARK} k/n = k of the n seeds had their best validation round in '
        "their last round (still improving when training stopped).",
        "",
        "| configuration | backbone | client | R-1 | R-2 | R-L | avg | significantly vs | seeds | missing seeds "
        "| best round last |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r in sub.sort_values(["label", "backbone", "client"]).iterrows():
        scores = [fmt(r[f"{m}_mean"], r[f"{m}_std"], r["n_seeds"]) for m in METRICS]
        versus = comparisons.significance_marks(compared, study, r["label"], r["client"])  # "significantly vs"
        mark = row_mark(converged, study, r["label"], r["client"]) or "–"
        cells = [*r[["label", "backbone", "client"]], *scores, versus, r["n_seeds"], r["missing_seeds"] or "–", mark]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    if budget := convergence_note(converged, [study]):
        lines += ["", budget]
    lines.append(comparisons.markdown_section(compared, study, bootstrap))
    return "\n".join(lines) + "\n"


# What pipeline.common.timing writes of a stage, with its type: the stage-time table's columns.
TIMING_FIELDS = {"stage": str, "seconds": float, "startup_seconds": float, "peak_rss_mb": float, "finished_at": str}


def timing_table(timing_dir: Path, planned_names: set[str]) -> tuple[pd.DataFrame | None, list[str]]:
    """The stage timing records, longest first, and the stages left out: train-/evaluate- records of experiments
    the `experiments` params no longer plan (DVC leaves a removed stage's outputs in place)."""
    rows, left_out = [], []
    for f in sorted(timing_dir.glob("*.json")):
        try:
            rec = json.loads(f.read_text())
            row = {key: kind(rec[key]) for key, kind in TIMING_FIELDS.items()}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise DataError(f"{f}: not a stage timing record of pipeline.common.timing ({err!r})") from err
        step, _, experiment = row["stage"].partition("-")
        if step in ("train", "evaluate") and experiment and experiment not in planned_names:
            left_out.append(row["stage"])
            continue
        rows.append(row)
    if not rows:
        return None, left_out
    return pd.DataFrame(rows).sort_values("seconds", ascending=False).reset_index(drop=True), left_out


def timing_markdown(timing: pd.DataFrame) -> str:
    """The stage-time table, its totals and the span from the first start to the last finish."""
    lines = [
        "# Stage wall times",
        "",
        "Each stage's last run (`reports/timing/<stage>.json`): its work, and the start-up of its process before it "
        "(interpreter, imports, arguments); DVC's work between stages is in neither.",
        "",
        "| stage | seconds | start-up (s) | peak RSS (MB) | finished (UTC) |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.stage} | {r.seconds:.1f} | {r.startup_seconds:.1f} | {r.peak_rss_mb:.0f} | {r.finished_at} |"
        for r in timing.itertuples()
    ]
    lines.append(
        f"| **total** | {timing['seconds'].sum():.1f} | "
        f"{timing['startup_seconds'].sum():.1f} | {timing['peak_rss_mb'].max():.0f} (max) | |"
    )
    finished = pd.to_datetime(timing["finished_at"], utc=True, format="ISO8601")
    started = finished - pd.to_timedelta(timing["seconds"] + timing["startup_seconds"], unit="s")
    span = (finished.max() - started.min()).total_seconds()  # one `dvc repro` of them all
    lines += ["", f"First recorded start to last recorded finish: {span:.0f} s ({span / 60:.1f} min)."]
    return "\n".join(lines) + "\n"
