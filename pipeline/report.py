"""Stage `report`: tables, figures and the index of everything the pipeline produced (METHOD.md section 7); what it
writes and how: pipeline.results.outputs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipeline.common import atomic, cli
from pipeline.common.config import from_dict, load_params
from pipeline.common.timing import stage_timer
from pipeline.paths import PATHS
from pipeline.planning import declared, resolve_plan
from pipeline.results import claims, comparisons, figures, human_eval, published
from pipeline.results.outputs import Made, build_report, results_text, write_tables
from pipeline.results.stats import BootstrapConfig
from pipeline.results.tables import ReportConfig, ReportInputs


def report_inputs(params: dict[str, Any] | str | Path, where: str = "params.yaml") -> ReportInputs:
    """The planned experiments, the `report` and `bootstrap` groups of ``params`` (read from ``where``; a path: the
    params file, read here) and the plan's `train` (params' with the entry's overrides) of each AdaCentralized and
    AdaSingle, checked before anything is written."""
    if not isinstance(params, dict):  # the stage's --params, a study folder's params.yaml
        params, where = load_params(params), str(params)
    return ReportInputs(
        planned := declared(params, where),
        from_dict(ReportConfig, params.get("report"), f"{where} report"),
        from_dict(BootstrapConfig, params.get("bootstrap"), f"{where} bootstrap"),
        {e.name: resolve_plan(e, params, where)["train"] for e in planned if e.method in ("centralized", "single")},
    )


def write_claims(folder: Path, files: list[Path], check: bool = False) -> list[Path]:
    """Rewrite the results block of each markdown file from the study folder (``comparisons.csv``, ``train/``,
    ``params.yaml``: reports/cpu-study), or with ``check`` only list the files whose block differs."""
    inp = report_inputs(folder / "params.yaml")
    source = folder / "comparisons.csv"
    block = results_text(inp, comparisons.read_table(source), source, folder)
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
    """`python -m pipeline.report rebuild` (docs/ARCHITECTURE.md): the tables, the learning curves and the README
    block; identical-summary fractions come from the folder's previous comparisons.csv where predictions are absent."""
    made = Made()
    inp = report_inputs(folder / "params.yaml")
    compared = write_tables(inp, folder, made, previous=folder / "comparisons.csv")[0]
    made.csv("tables", folder / "comparisons.csv", compared)
    figures.learning_curves(inp, folder, made)
    readme_path = folder / "README.md"
    if readme_path.is_file() and claims.BEGIN in readme_path.read_text(encoding="utf-8"):
        write_claims(folder, [readme_path])
        made.files["text"] = [str(readme_path)]
    return {"made": made.files, "not_made": made.not_made}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__.split("\n")[0])
    cli.add_params(parser)
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
        verb = "differs from" if args.check else "rewritten from"
        for f in changed:
            print(f"{f}: results block {verb} {args.folder}", file=sys.stderr)
        return 1 if (args.check and changed) else 0
    if args.command == "human":  # the paper's counts beside ours
        results = {**human_eval.score_sheets(args.sheets), "published": published.HUMAN_EVAL}
        atomic.write_json(args.out / "results.json", results)
        human_eval.plot_results(results, args.out / "human_eval.png")
        print(json.dumps(results["opponents"], indent=2))
        print(f"wrote {args.out / 'results.json'} and {args.out / 'human_eval.png'}", file=sys.stderr)
        return 0
    inp = report_inputs(args.params)
    with stage_timer("report"):
        index = build_report(inp, PATHS)
    made = {k: len(v) for k, v in index["made"].items()}
    counts = {"made": made, "not_made": index["not_made"], "missing_experiments": len(index["missing_experiments"])}
    print(json.dumps(counts, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
