"""Stage `report`: tables, figures and the index of everything the pipeline produced (METHOD.md section 7)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.common import atomic
from pipeline.common.cli import run as run_cli
from pipeline.common.config import PositiveInt, config, from_dict, group, load_params
from pipeline.common.timing import stage_timer
from pipeline.experiments.entries import Experiment, with_labels
from pipeline.experiments.settings import RUN_TRAIN_KEYS
from pipeline.experiments.train_config import train_config
from pipeline.paths import PATHS, ProjectPaths
from pipeline.planning import declared
from pipeline.results import claims, comparisons, figures, human_eval, outputs, published, tables
from pipeline.results.readers import centralized_step_ratios, collect_scores, convergence_table
from pipeline.results.stats import BootstrapConfig


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


@dataclass
class Tables:
    planned: list[Experiment]
    labels: dict[str, str]
    bootstrap: BootstrapConfig
    compared: pd.DataFrame  # the comparisons table with the published columns
    scores: pd.DataFrame
    agg: pd.DataFrame
    missing_eval: list[str]
    made: dict[str, list[str]]  # what was written, by kind, and what was not, with why
    not_made: dict[str, str]


def shared_seeds(scores: pd.DataFrame) -> list[int]:
    """The seeds every configuration (label) of ``scores`` has evaluated."""
    by_label = [set(g["seed"].astype(int)) for _, g in scores.groupby("label")]
    return sorted(set.intersection(*by_label)) if by_label else []


def write_tables(params: dict[str, Any], cfg: ReportConfig, reports: Path, previous: Path | None = None) -> Tables:
    """The comparisons, the scores, the main table per backbone and one table per study into ``reports/tables``, from
    ``reports/eval`` and ``reports/train`` (reports/ or a study folder). ``previous``: a comparisons.csv whose
    identical-summary fractions fill those the missing predictions leave out."""
    made: dict[str, list[str]] = defaultdict(list)
    not_made: dict[str, str] = {}
    tables_dir = reports / "tables"
    bootstrap = from_dict(BootstrapConfig, params.get("bootstrap"), "bootstrap")  # before anything is written
    planned = declared(params)
    labels = with_labels(planned)
    scores, missing_eval = collect_scores(planned, labels, reports / "eval")
    agg = figures.pre_addition_stand_in(tables.aggregate(scores, planned, labels, cfg.expected_seeds))
    converged = convergence_table(planned, labels, reports / "train")

    # Which differences are real: every configuration against its baselines (paired bootstrap), beside the paper's.
    compared, notes = comparisons.comparisons_table(
        comparisons.configurations(planned, labels), cfg.baselines, reports / "eval", bootstrap
    )
    if previous is not None and previous.is_file():
        compared = comparisons.carry_identical(compared, pd.read_csv(previous), bootstrap)
    compared = comparisons.with_published(compared)
    if notes:
        not_made["comparisons"] = "; ".join(notes)
    for frame, name in ((compared, "comparisons"), (scores, "scores_per_experiment"), (agg, "scores_aggregated")):
        atomic.to_csv(frame, tables_dir / f"{name}.csv", index=False)
        made["tables"].append(str(tables_dir / f"{name}.csv"))

    # Main table per backbone (Table III layout) beside the published numbers.
    main = agg[agg["study"] == "main"]
    if main.empty:
        not_made["main table"] = "no evaluated experiment of study `main`"
    for backbone in sorted(set(main["backbone"])):
        # the seeds every main method has, so no method's mean is over seeds another lacks
        seeds = shared_seeds(scores[(scores["study"] == "main") & (scores["backbone"] == backbone)])
        kept = scores[(scores["study"] != "main") | scores["seed"].isin(seeds)] if seeds else scores
        paired = figures.pre_addition_stand_in(tables.aggregate(kept, planned, labels, cfg.expected_seeds))
        table = tables.main_table(paired, backbone, planned, labels, cfg.expected_seeds)
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", backbone.rsplit("/", 1)[-1]).strip("-").lower() or "unknown"
        stem = tables_dir / f"main_{slug}"
        atomic.to_csv(table, stem.with_suffix(".csv"), index=False)
        note = (
            f"\nEvery method's numbers are over the seeds all of them have ({', '.join(map(str, seeds))}; "
            "`scores_aggregated.csv` and the study table have each method's own seeds).\n"
            if seeds
            else "\nNo seed is shared by every method: each row is over its own seeds (column `seeds`).\n"
        )
        text = tables.main_table_markdown(table, backbone, compared, bootstrap, converged)
        atomic.write_text(stem.with_suffix(".md"), text + note)
        made["tables"] += [str(stem.with_suffix(".md")), str(stem.with_suffix(".csv"))]

    # One table per study, with its paired comparisons and its runs' convergence.
    for study in sorted(set(agg["study"])):
        path = tables_dir / f"study_{study}.md"
        atomic.write_text(path, tables.study_table_markdown(agg, study, compared, bootstrap, converged))
        made["tables"].append(str(path))
    return Tables(planned, labels, bootstrap, compared, scores, agg, missing_eval, made, not_made)


def results_text(params: dict[str, Any], cfg: ReportConfig, compared: pd.DataFrame, source: Path, root: Path) -> str:
    """The results in words (pipeline.results.comparisons) under the profile's claim rules; ``root`` holds
    ``backbone.json``, ``analysis/kd_analysis.json`` and the train records ``train/`` (reports/ or a study folder)."""
    records = [
        json.loads(f.read_text()) if f.is_file() else None
        for f in (root / "backbone.json", root / "analysis" / "kd_analysis.json")
    ]
    planned = declared(params)
    converged = convergence_table(planned, with_labels(planned), root / "train")
    # How AdaCentralized's steps were budgeted (`train.centralized_steps`)
    train = train_config({k: v for k, v in group(params, "train").items() if k not in RUN_TRAIN_KEYS})
    ratios = centralized_step_ratios(planned, root / "train", train.batch_size, train.grad_accum_steps)
    scale = claims.ClaimScale(cfg.smoke, cfg.claim_min_seeds, cfg.claim_min_examples, train.centralized_steps, ratios)
    return claims.results_text(compared, converged, scale, source=str(source), backbone=claims.backbone_note(*records))


def build_report(params: dict[str, Any], cfg: ReportConfig, paths: ProjectPaths = PATHS) -> dict[str, Any]:
    """Everything the stage writes; returns the index (what was made and what is missing)."""
    t = write_tables(params, cfg, paths.reports)
    planned, labels, made, not_made = t.planned, t.labels, t.made, t.not_made
    for d in (paths.figures, paths.plots):
        d.mkdir(parents=True, exist_ok=True)
    atomic.write_text(
        paths.tables / "results.md",
        "# Results\n\n" + results_text(params, cfg, t.compared, paths.tables / "comparisons.csv", paths.reports),
    )
    made["tables"].append(str(paths.tables / "results.md"))

    # Figures: the registered studies' (pipeline.results.figures.STUDY_FIGURES), then the learning curves.
    drawn, figures_not_made = figures.study_figures(t.agg, paths.figures, paths.plots)
    made["figures"] += drawn
    not_made.update(figures_not_made)
    points = figures.privacy_points(planned, labels, t.scores, paths.train_reports)
    if not points.empty:
        made["figures"].append(
            str(figures.privacy_figure(points, paths.figures / "privacy.png", paths.plots / "privacy.csv"))
        )
    curves = figures.learning_curves(planned, labels, paths.train_reports, paths.figures, paths.plots)
    made["figures"] += curves
    if not curves:
        not_made["learning curves"] = "no reports/train/<exp>/rounds.json of a planned experiment"

    # Case study and human-evaluation sheets from the main study's lowest evaluated seed.
    preds, pred_seed = human_eval.predictions_by_method(planned, paths.eval_reports, "main")
    queries, meetings = human_eval.example_info(paths.examples)
    text = human_eval.case_study(preds, queries, cfg.case_study_seed) if preds else None
    if text is None:
        not_made["case study"] = "needs predictions of both fedavg and fedselectkd in study `main`"
    else:
        atomic.write_text(paths.tables / "case_study.md", text)
        made["tables"].append(str(paths.tables / "case_study.md"))
    sheets_dir = paths.human_eval / "sheets"
    if cfg.human_eval_target in preds and len(preds) > 1:
        summary = human_eval.make_sheets(
            preds,
            sheets_dir,
            target=cfg.human_eval_target,
            queries=queries,
            meetings=meetings,
            per_domain=cfg.human_eval_per_domain,
            seed=cfg.human_eval_seed,
        )
        made["human evaluation"] = [str(sheets_dir / f) for f in ("sheet.csv", "sheet.html", "key.json")]
        made["human evaluation"].append(
            f"{summary['items']} comparisons, {summary['examples_per_domain']} "
            f"examples per domain, seed {pred_seed} runs"
        )
    else:
        sheets_dir.mkdir(parents=True, exist_ok=True)
        not_made["human evaluation sheets"] = (
            f"needs predictions of {cfg.human_eval_target} and at least one other method in study `main`"
        )

    planned_names = {p.name for p in planned}
    timing, stale_timing = tables.timing_table(paths.timing, planned_names)
    if stale_timing:
        not_made["stage times of unplanned experiments"] = "left out of the stage-time table: " + ", ".join(
            stale_timing
        )
    if timing is None:
        not_made["stage times"] = "no reports/timing/*.json"
    else:
        atomic.to_csv(timing, paths.tables / "timing.csv", index=False)
        atomic.write_text(paths.tables / "timing.md", tables.timing_markdown(timing))
        made["tables"] += [str(paths.tables / "timing.md"), str(paths.tables / "timing.csv")]

    atomic.write_json(
        paths.reports / "summary.json", outputs.summary_metrics(t.agg, planned, t.missing_eval), sort_keys=True
    )
    intervals = {
        c.label: outputs.average_interval(c, paths.eval_reports, t.bootstrap)
        for c in comparisons.configurations(planned, labels)
        if c.study == outputs.HEADLINE_STUDY
    }
    kd = json.loads(paths.kd_analysis.read_text()) if paths.kd_analysis.is_file() else {}
    atomic.write_json(paths.reports / "metrics.json", outputs.headline_metrics(t.agg, intervals, kd), sort_keys=True)
    # Evaluations of experiments no longer in params.yaml are left out of every table; say which.
    ignored = (
        sorted(d.name for d in paths.eval_reports.iterdir() if d.is_dir() and d.name not in planned_names)
        if paths.eval_reports.is_dir()
        else []
    )
    short = t.agg[t.agg["missing_seeds"] != ""]
    incomplete = list(
        dict.fromkeys(f"{r.study}: {r.label} (missing seed {r.missing_seeds})" for r in short.itertuples())
    )
    index = {
        "made": dict(made),
        "not_made": not_made,
        "missing_experiments": t.missing_eval,
        "incomplete_seeds": incomplete,
        "ignored_evaluations": ignored,
    }
    atomic.write_text(paths.reports / "README.md", outputs.readme(index, len(planned), paths.reports, paths.plots))
    return index


def write_claims(folder: Path, files: list[Path], check: bool = False) -> list[Path]:
    """Rewrite the results block of each markdown file from the study folder (``comparisons.csv``, ``train/``,
    ``params.yaml``: reports/cpu-study), or with ``check`` only list the files whose block differs."""
    params = load_params(folder / "params.yaml")
    cfg = from_dict(ReportConfig, params.get("report"), f"{folder / 'params.yaml'} report")
    source = folder / "comparisons.csv"
    block = results_text(params, cfg, pd.read_csv(source), source, folder)
    changed = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        new = claims.replace_block(text, block, str(f))
        if new != text:
            changed.append(f)
            if not check:
                atomic.write_text(f, new)
    return changed


def rebuild_study(folder: Path) -> dict[str, Any]:
    """`python -m pipeline.report rebuild` (docs/ARCHITECTURE.md), README block included; identical-summary fractions
    come from the folder's previous comparisons.csv where predictions are absent."""
    params = load_params(folder / "params.yaml")
    cfg = from_dict(ReportConfig, params.get("report"), "report")
    written = write_tables(params, cfg, folder, previous=folder / "comparisons.csv")
    made = written.made
    atomic.to_csv(written.compared, folder / "comparisons.csv", index=False)
    made["tables"].append(str(folder / "comparisons.csv"))
    readme_path = folder / "README.md"
    if readme_path.is_file() and claims.BEGIN in readme_path.read_text(encoding="utf-8"):
        write_claims(folder, [readme_path])
        made["text"] = [str(readme_path)]
    return {"made": made, "not_made": written.not_made}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="params.yaml")
    sub = parser.add_subparsers(dest="command")
    human = sub.add_parser("human", help="score filled human-evaluation sheets (the report stage writes them blank)")
    human.add_argument(
        "--sheets",
        metavar="DIR",
        type=Path,
        required=True,
        help="score the filled sheet*.csv files in DIR (key.json beside them)",
    )
    human.add_argument(
        "--out", type=Path, default=Path("reports/human_eval"), help="where results.json and the chart go"
    )
    rebuild = sub.add_parser(
        "rebuild",
        help="recompute a study folder's comparisons and tables from its committed scores (e.g. reports/cpu-study)",
    )
    rebuild.add_argument("folder", type=Path)
    text = sub.add_parser(
        "claims",
        help="rewrite the results block (<!-- results:begin/end -->) of markdown files "
        "from a study folder's comparisons.csv and train records",
    )
    text.add_argument("folder", type=Path, help="the study folder (comparisons.csv, train/, params.yaml)")
    text.add_argument("files", nargs="+", type=Path, help="markdown files with a results block")
    text.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs")
    args = parser.parse_args(argv)
    if args.command == "rebuild":
        print(json.dumps(rebuild_study(args.folder), indent=2))
        return 0
    if args.command == "claims":
        changed = write_claims(args.folder, args.files, check=args.check)
        for f in changed:
            print(
                f"{f}: results block {'differs from' if args.check else 'rewritten from'} {args.folder}",
                file=sys.stderr,
            )
        return 1 if (args.check and changed) else 0
    if args.command == "human":  # the paper's counts beside ours
        results = {**human_eval.score_sheets(args.sheets), "published": published.HUMAN_EVAL}
        atomic.write_json(args.out / "results.json", results)
        human_eval.plot_results(results, published.HUMAN_EVAL, args.out / "human_eval.png")
        print(json.dumps(results["opponents"], indent=2))
        print(f"wrote {args.out / 'results.json'} and {args.out / 'human_eval.png'}", file=sys.stderr)
        return 0
    params = load_params(args.params)
    cfg = from_dict(ReportConfig, params.get("report"), "report")
    with stage_timer("report"):
        index = build_report(params, cfg, PATHS)
    made = {k: len(v) for k, v in index["made"].items()}
    counts = {"made": made, "not_made": index["not_made"], "missing_experiments": len(index["missing_experiments"])}
    print(json.dumps(counts, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
