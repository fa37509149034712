"""What the report stage writes (pipeline/report.py reads the params and calls :func:`build_report`): its tables
(pipeline.results.tables), the results in words (pipeline.results.claims), figures, case study and human-evaluation
sheets, reports/summary.json, reports/metrics.json (the DVC metrics file) and reports/README.md (the index of
everything made and not made)."""

from __future__ import annotations

import functools
import math
import os
import re
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.common import atomic
from pipeline.common.schema import read_json
from pipeline.experiments.train_config import UNITS
from pipeline.paths import ProjectPaths
from pipeline.results import claims, comparisons, figures, human_eval, tables
from pipeline.results.readers import centralized_step_ratios, collect_scores, convergence_table
from pipeline.results.scoring import TABLE_ROUGE_L
from pipeline.results.stats import BootstrapConfig, meetings, nested_interval
from pipeline.results.tables import Made, ReportInputs


def shared_seeds(scores: pd.DataFrame) -> list[int]:
    """The seeds every configuration (label) of ``scores`` has evaluated."""
    by_label = [set(g["seed"].astype(int)) for _, g in scores.groupby("label")]
    return sorted(set.intersection(*by_label)) if by_label else []


def write_tables(
    inp: ReportInputs, reports: Path, made: Made, previous: Path | None = None
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, list[str]]:
    """The comparisons, the scores, the main table per backbone and one table per study into ``reports/tables``, from
    ``reports/eval`` and ``reports/train`` (reports/ or a study folder); returns the comparisons, the scores, their
    aggregate and the planned experiments without an evaluation. ``previous``: a comparisons.csv whose
    identical-summary fractions fill those the missing predictions leave out."""
    tables_dir, planned, labels, bootstrap = reports / "tables", inp.planned, inp.labels, inp.bootstrap
    scores, missing_eval = collect_scores(planned, labels, reports / "eval")
    agg = figures.pre_addition_stand_in(tables.aggregate(scores, inp))
    converged = convergence_table([p for p in planned if p.name not in missing_eval], labels, reports / "train")

    # Which differences are real: every configuration against its baselines (paired bootstrap), beside the paper's.
    compared, notes = comparisons.comparisons_table(inp.configurations, inp.cfg.baselines, reports / "eval", bootstrap)
    if previous is not None and previous.is_file():
        compared = comparisons.carry_identical(
            compared, comparisons.read_table(previous, ("identical_fraction",)), bootstrap
        )
    compared = comparisons.with_published(compared)
    if notes:
        made.not_made["comparisons"] = "; ".join(notes)
    for frame, name in ((compared, "comparisons"), (scores, "scores_per_experiment"), (agg, "scores_aggregated")):
        made.csv("tables", tables_dir / f"{name}.csv", frame)

    # Main table per backbone (Table III layout) beside the published numbers.
    main = agg[agg["study"] == "main"]
    if main.empty:
        made.not_made["main table"] = "no evaluated experiment of study `main`"
    for backbone in sorted(set(main["backbone"])):
        # the seeds every main method has, so no method's mean is over seeds another lacks
        seeds = shared_seeds(scores[(scores["study"] == "main") & (scores["backbone"] == backbone)])
        kept = scores[(scores["study"] != "main") | scores["seed"].isin(seeds)] if seeds else scores
        shown = tables.aggregate(kept, inp)
        # a seed left out because another method lacks it is not missing: the missing seeds are the unevaluated ones
        keys = ["study", "label", "backbone", "client"]
        missing = agg.set_index(keys)["missing_seeds"].reindex(pd.MultiIndex.from_frame(shown[keys]))
        table = tables.main_table(shown.assign(missing_seeds=missing.to_numpy()), backbone, inp)  # main rows only
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", backbone.rsplit("/", 1)[-1]).strip("-").lower() or "unknown"
        stem = tables_dir / f"main_{slug}"
        note = (
            f"\nEvery method's numbers are over the seeds all of them have ({', '.join(map(str, seeds))}; "
            "`scores_aggregated.csv` and the study table have each method's own seeds).\n"
            if seeds
            else "\nNo seed is shared by every method: each row is over its own seeds (column `seeds`).\n"
        )
        runs = converged[converged["seed"].isin(seeds)] if seeds else converged  # the runs of the table's numbers
        text = tables.main_table_markdown(table, backbone, compared, bootstrap, runs)
        made.text("tables", stem.with_suffix(".md"), text + note)
        made.csv("tables", stem.with_suffix(".csv"), table)

    # One table per study, with its paired comparisons and its runs' convergence.
    for study in sorted(set(agg["study"])):
        text = tables.study_table_markdown(agg, study, compared, bootstrap, converged)
        made.text("tables", tables_dir / f"study_{study}.md", text)
    return compared, scores, agg, missing_eval


def results_text(inp: ReportInputs, compared: pd.DataFrame, source: Path, root: Path) -> str:
    """The results in words (pipeline.results.claims) under the profile's claim rules; ``root`` holds
    ``backbone.json``, ``analysis/kd_analysis.json`` and the train records ``train/`` (reports/ or a study folder)."""
    records = [
        read_json(f, f.name) if f.is_file() else None
        for f in (root / "backbone.json", root / "analysis" / "kd_analysis.json")
    ]
    # the round budget of the evaluated runs, whose scores the comparisons hold (as the tables' marks: write_tables)
    evaluated = [p for p in inp.planned if (root / "eval" / p.name / "metrics.json").is_file()]
    converged = convergence_table(evaluated, inp.labels, root / "train")
    # How AdaCentralized's steps were budgeted (its plan's `train.centralized_steps`)
    pooled = [inp.train[e.name] for e in inp.planned if e.study == "main" and e.method == "centralized"]
    ratios = centralized_step_ratios(inp.planned, root / "train", inp.train)
    steps = pooled[0]["centralized_steps"] if pooled else "largest_client"
    # A KD record written before kd_analysis.json held tau_unit: the unit of the entropy_log_base its runs are declared
    # with in the study's params, when all of them are, as one absolute entropy gate at its tau (else none is given).
    if (kd := records[1]) and kd.get("tau") is not None and "tau_unit" not in kd:
        ran = {n for c in (kd.get("clients") or {}).values() for n in c.get("experiments", [])}
        gates = {(e.tau, e.tau_scale, e.kd_gate, UNITS[e.entropy_log_base]) for e in inp.planned if e.name in ran}
        every = len(ran) == sum(e.name in ran for e in inp.planned)
        if every and len(gates) == 1 and (gate := gates.pop())[:3] == (kd["tau"], "absolute", "entropy"):
            kd["tau_unit"] = gate[3]
    note = claims.backbone_note(*records)
    return claims.results_text(compared, converged, inp.cfg, inp.bootstrap.level, steps, ratios, str(source), note)


def build_report(inp: ReportInputs, paths: ProjectPaths) -> dict[str, Any]:
    """Everything the stage writes; returns the index (what was made and what is missing)."""
    made, planned, cfg = Made(), inp.planned, inp.cfg
    compared, scores, agg, missing_eval = write_tables(inp, paths.reports, made)
    for d in (paths.figures, paths.plots):
        d.mkdir(parents=True, exist_ok=True)
    text = results_text(inp, compared, paths.tables / "comparisons.csv", paths.reports)
    made.text("tables", paths.tables / "results.md", "# Results\n\n" + text)

    # Figures: the registered studies' (pipeline.results.figures.STUDY_FIGURES), then the learning curves.
    figures.study_figures(agg, paths, made)
    points = figures.privacy_points(inp, scores, paths)
    if not points.empty:
        made.files["figures"].append(figures.privacy_figure(points, paths))
    if not figures.learning_curves(inp, paths.reports, made):
        made.not_made["learning curves"] = "no reports/train/<exp>/rounds.json of a planned experiment"

    # Sheets: the main study's lowest seed with the target and another method; case study: with FedAvg and SelectKD.
    preds, pred_seed = human_eval.predictions_by_method(planned, paths.eval_reports, cfg.human_eval_target)
    queries, meeting_of = human_eval.example_info(paths.examples)
    case_preds = human_eval.predictions_by_method(planned, paths.eval_reports, "fedselectkd", "fedavg")[0]
    text = human_eval.case_study(case_preds, queries, cfg.case_study_seed)
    if text is None:
        made.not_made["case study"] = "needs predictions of both fedavg and fedselectkd in study `main`"
    else:
        made.text("tables", paths.tables / "case_study.md", text)
    sheets_dir = paths.human_eval / "sheets"
    if cfg.human_eval_target in preds and len(preds) > 1:
        summary = human_eval.make_sheets(preds, sheets_dir, cfg, queries, meeting_of, pred_seed)
        made.files["human evaluation"] = [str(f) for f in sorted(sheets_dir.glob("sheet*.*"))] + [
            str(sheets_dir / "key.json"),
            f"{summary['items']} comparisons, {summary['examples_per_domain']} examples per domain, seed {pred_seed} runs",
        ]
    else:
        sheets_dir.mkdir(parents=True, exist_ok=True)
        made.not_made["human evaluation sheets"] = (
            f"needs predictions of {cfg.human_eval_target} and at least one other method in study `main`"
        )

    planned_names = {p.name for p in planned}
    timing, stale_timing = tables.timing_table(paths.timing, planned_names)
    if stale_timing:
        left_out = ", ".join(stale_timing)
        made.not_made["stage times of unplanned experiments"] = f"left out of the stage-time table: {left_out}"
    if timing is None:
        made.not_made["stage times"] = "no reports/timing/*.json"
    else:
        made.text("tables", paths.tables / "timing.md", tables.timing_markdown(timing))
        made.csv("tables", paths.tables / "timing.csv", timing)

    # reports/summary.json: average ROUGE per study, configuration and client, and the mean over clients
    averages: dict[str, Any] = {
        "experiments_planned": len(planned),
        "experiments_missing": len(missing_eval),
        "experiments_evaluated": len(planned) - len(missing_eval),
    }
    for (study, label), grp in agg.groupby(["study", "label"], sort=True):
        entry = {client: round(float(v), 4) for client, v in zip(grp["client"], grp["avg_rouge_mean"])}
        entry["mean_over_clients"] = round(float(grp["avg_rouge_mean"].mean()), 4)
        entry["n_seeds"] = int(grp["n_seeds"].min())
        averages.setdefault(study, {})[label.replace(" ", "_")] = entry
    atomic.write_json(paths.reports / "summary.json", averages, sort_keys=True)
    intervals = {
        c.label: average_interval(c, paths.eval_reports, inp.bootstrap)
        for c in inp.configurations
        if c.study == HEADLINE_STUDY
    }
    kd = read_json(paths.kd_analysis, "KD analysis") if paths.kd_analysis.is_file() else {}
    atomic.write_json(paths.reports / "metrics.json", headline_metrics(agg, intervals, kd), sort_keys=True)
    # Evaluations of experiments no longer in params.yaml are left out of every table; say which.
    ignored = sorted(d.name for d in paths.eval_reports.glob("*") if d.is_dir() and d.name not in planned_names)
    short = agg[agg["missing_seeds"] != ""]
    incomplete = list(
        dict.fromkeys(
            f"{r.study}: {r.label} (missing seed{'s' * (',' in r.missing_seeds)} {r.missing_seeds})"
            for r in short.itertuples()
        )
    )
    index = {
        "made": dict(made.files),
        "not_made": made.not_made,
        "missing_experiments": missing_eval,
        "incomplete_seeds": incomplete,
        "ignored_evaluations": ignored,
    }
    atomic.write_text(paths.reports / "README.md", readme(index, len(planned), paths.reports))
    return index


# reports/metrics.json, the one DVC metrics file: what `dvc exp show` / `dvc metrics diff` put side by side across
# DVC experiments. Only the main study's results (the study `-S tau=...` ablates): every other report file is a
# plain output, and no time or memory figure is a metric (they differ between runs of the same experiment).
HEADLINE_STUDY = "main"
HEADLINE_ROUGE = {"rouge1": "rouge1", "rouge2": "rouge2", "rougeL": TABLE_ROUGE_L, "avg_rouge": "avg_rouge"}


def average_interval(config: comparisons.Config, eval_dir: Path, cfg: BootstrapConfig) -> tuple[float, float] | None:
    """Interval of a configuration's client-average avg ROUGE (or None): seeds on one test split crossed, seeds with
    their own test examples nested (each seed's full test sets; None when a client lacks some seed)."""
    frames = [f for _, name in config.runs if (f := comparisons.per_example(eval_dir, name)) is not None]
    ids = [comparisons.shared_ids(f) for f in frames]
    if not ids or not ids[0] or any(i.keys() != ids[0].keys() for i in ids):
        return None
    scores = [  # seed, client
        [comparisons.client_rows(f, c, e)["avg_rouge"].to_numpy(float) for c, e in i.items()]
        for f, i in zip(frames, ids)
    ]
    clusters = [meetings(i.values()) for i in ids]
    r = nested_interval(scores, cfg, clusters, paired=False, crossed=all(i == ids[0] for i in ids))
    return None if math.isnan(r.low) else (r.low, r.high)  # NaN: a client of one meeting or example has no interval


def headline_metrics(
    agg: pd.DataFrame, intervals: dict[str, tuple[float, float] | None], kd_analysis: dict[str, Any]
) -> dict[str, Any]:
    """reports/metrics.json's content (docs/ARCHITECTURE.md): ``intervals`` by label; ``kd_analysis`` is
    reports/analysis/kd_analysis.json."""
    out: dict[str, Any] = {}
    main = agg[agg["study"] == HEADLINE_STUDY]
    # Keyed by method, so an ablation (`-S tau=4` relabels "fedselectkd tau=5") stays in the same DVC metric column;
    # by label only where the study holds several configurations of one method.
    methods = main.groupby("label")["method"].first()
    keys = methods.where(~methods.duplicated(keep=False), methods.index.str.replace(" ", "_"))
    for label, grp in main.groupby("label", sort=True):
        entry: dict[str, Any] = {k: round(float(grp[f"{col}_mean"].mean()), 4) for k, col in HEADLINE_ROUGE.items()}
        if (interval := intervals.get(label)) is not None:
            entry["avg_rouge_low"], entry["avg_rouge_high"] = (round(float(v), 4) for v in interval)
        entry["clients"] = {str(c): round(float(v), 4) for c, v in zip(grp["client"], grp["avg_rouge_mean"])}
        out.setdefault(HEADLINE_STUDY, {})[str(keys[label])] = entry
    usage = {
        str(c): round(float(v["kd_usage_ratio"]), 4)
        for c, v in sorted(kd_analysis.get("clients", {}).items())
        if isinstance(v, dict) and v.get("kd_usage_ratio") is not None
    }
    if usage:
        out["kd_usage"] = {**usage, "mean": round(sum(usage.values()) / len(usage), 4)}
    return out


# What other stages wrote that the index lists too (globs under reports/).
OTHER_OUTPUTS = (
    "data/*.md data/*.json partitions/*.png analysis/*.json analysis/*.csv analysis/figures/*.png backbone.json "
    "eval/*/metrics.json"
).split()


def readme(index: dict[str, Any], n_planned: int, out: Path) -> str:
    """The index of ``out`` (the reports directory) from ``index``: what was made, what not and why."""
    rel = functools.partial(os.path.relpath, start=out)
    lines = [
        "# fedmeet reports",
        "",
        "Generated by `dvc repro report` (`python -m pipeline.report`). ROUGE is F1 x 100 from `rouge-score` with "
        f"Porter stemming; the tables' R-L is `{TABLE_ROUGE_L}` (as the paper's R-L, by its R-L / R-1 ratios; "
        "`rougeLsum` is its own column). Every number is a mean over the seeds present; missing seeds are "
        "printed beside it.",
        "",
        f"Experiments planned: {n_planned}; evaluated: {n_planned - len(index['missing_experiments'])}.",
        "",
    ]
    # each section a list of links (an entry that is no file, e.g. the sheets' counts, as it is)
    sections = [(s.capitalize(), index["made"].get(s, [])) for s in ("tables", "figures", "human evaluation")]
    sections += [("Plot data (`dvc plots show`)", sorted((out / "plots").rglob("*.csv")))]
    sections += [("Other stage outputs", [p for pattern in OTHER_OUTPUTS for p in sorted(out.glob(pattern))])]
    for title, items in ((t, i) for t, i in sections if i):
        lines += [f"## {title}", "", *(f"- [{rel(i)}]({rel(i)})" if Path(i).exists() else f"- {i}" for i in items), ""]
    lines += ["## Not produced", ""]
    if not index["not_made"] and not index["missing_experiments"] and not index["incomplete_seeds"]:
        lines.append("Nothing: every planned experiment is evaluated with every expected seed.")
    lines += [f"- {what}: {why}" for what, why in sorted(index["not_made"].items())]
    if index["missing_experiments"]:
        lines += ["", "Planned experiments without an evaluation (`reports/eval/<exp>/metrics.json`):", ""]
        lines += [f"- `{name}`" for name in index["missing_experiments"]]
    if index["ignored_evaluations"]:
        lines += ["", "Evaluations left out because their experiment is not in the `experiments` params:", ""]
        lines += [f"- `reports/eval/{name}`" for name in index["ignored_evaluations"]]
    if index["incomplete_seeds"]:
        lines += ["", "Configurations averaged over fewer seeds than expected (`report.expected_seeds`):", ""]
        lines += [f"- {x}" for x in index["incomplete_seeds"]]
    lines += [
        "",
        "## Human evaluation",
        "",
        "Blind sheets: `reports/human_eval/sheets/` (give each annotator one `sheet<k>.html` or `sheet<k>.csv`, "
        "each shows an example once; never `key.json`). Copy the sheets elsewhere, fill the `judgement` column "
        "(A, B or tie) or download it from the HTML page as `sheet<k>_<name>.csv`; keep the `kit` column (the "
        "kit's id: a sheet without it, or of another kit, is refused), then run "
        "`python -m pipeline.report human --sheets DIR` -> `reports/human_eval/results.json` and "
        "`reports/human_eval/human_eval.png` (paper: SelectKD vs FedAvg 52 wins, 4 ties, 4 losses of 60).",
        "",
    ]
    return "\n".join(lines)
