"""Stage `evaluate`: each client's chosen local adapter summarises the client's own test set; ROUGE per example.

Outputs ``reports/eval/<exp>/`` (docs/ARCHITECTURE.md) and the scores in the experiment's MLflow runs; generated text
stays on disk unless ``evaluate.log_text_to_mlflow`` is true (privacy: summaries are client data).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from pipeline.common import cli
from pipeline.common.schema import DataError
from pipeline.common.timing import stage_timer
from pipeline.results.evaluation import EvaluateConfig, log_to_mlflow
from pipeline.results.experiment_evaluation import evaluate_experiments
from pipeline.results.readers import read_json, run_converged
from pipeline.results.scoring import SCORE_KEYS, score_files
from pipeline.results.stats import BootstrapConfig
from pipeline.results.tracking import download_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.evaluate", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="evaluate one experiment (the DVC stage)")
    run.add_argument("--experiment", required=True, help="key of params.yaml `experiments`")
    cli.add_params(run)
    run.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    score = sub.add_parser("score", help="ROUGE of line-aligned prediction/reference files, printed as JSON")
    score.add_argument("--pred", required=True, help="predictions, one summary per line")
    score.add_argument("--ref", required=True, help="references, one summary per line")
    logged = sub.add_parser("model", help="score a client's adapter logged in MLflow on its client's test subsample")
    logged.add_argument("model", help="the LoggedModel's id (m-...) or models:/<id>")
    cli.add_params(logged)
    imp = sub.add_parser("import-eval", help="log evaluation records (metrics.json) into the MLflow store")
    imp.add_argument("records", nargs="+", type=Path, help="reports/.../eval/<exp>/metrics.json files")
    imp.add_argument("--study", help="MLflow experiment to log into (default: each record's study)")
    args = parser.parse_args(argv)
    if args.command == "import-eval":  # each record into its training run, else into a new run of its study
        for path in args.records:
            metrics = read_json(path, "evaluation record (reports/eval/<exp>/metrics.json)")
            if missing := [k for k in ("experiment", "clients", "mean") if k not in metrics]:
                raise DataError(f"{path}: not an evaluation record (missing {missing})")
            # every score it logs, checked before a run is opened (a traceback mid-logging left that run RUNNING)
            if not isinstance(metrics["clients"], dict) or not all(
                isinstance(s, dict) and all(type(s.get(k, "")) in (int, float, type(None)) for k in SCORE_KEYS)
                for s in [metrics["mean"], *metrics["clients"].values()]  # a null: not logged (no client, a mean)
            ):
                raise DataError(
                    f"{path}: not an evaluation record ('mean' and each client need numbers {list(SCORE_KEYS)})"
                )
            # what names it: its training run's tags, if its study holds that run (evaluated with `--no-mlflow`)
            record = {k: str(metrics[k]) for k in ("method", "partition", "seed") if metrics.get(k) is not None}
            # the train record beside it (<folder>/train/<exp>/, as reports/cpu-study lays them out): `converged`
            converged = run_converged(path.parent.parent.parent / "train", metrics["experiment"])
            study = {"study": args.study or metrics.get("study") or "main"}
            log_to_mlflow(record | study, metrics, path.parent, EvaluateConfig(), converged, run_tags=record)
        print(f"evaluate: logged {len(args.records)} evaluation record(s) to MLflow")
    elif args.command == "score":  # a bad file: DataError, one line and exit 2 (pipeline.common.cli.run)
        # keys sorted: the same scores print as the same bytes, whatever order they were computed in
        print(json.dumps(score_files(args.pred, args.ref), indent=2, sort_keys=True))
    else:
        _, cfg, bootstrap = cli.read_params(args.params, evaluate=EvaluateConfig, bootstrap=BootstrapConfig)
        if args.command == "model":
            with tempfile.TemporaryDirectory() as tmp:
                tags = download_model(args.model, Path(tmp))
                out = evaluate_experiments(
                    [tags["experiment"]],
                    dataclasses.replace(cfg, adapter="best"),
                    models_dir=Path(tmp),
                    eval_dir=Path(tmp) / "eval",
                    mlflow_logging=False,
                    bootstrap=bootstrap,
                    only=tags["client"],
                )[tags["experiment"]]
            print(json.dumps({"model": args.model, **tags, **out["clients"][tags["client"]]}, indent=1))
        else:
            with stage_timer(f"evaluate-{args.experiment}"):
                evaluate_experiments([args.experiment], cfg, mlflow_logging=not args.no_mlflow, bootstrap=bootstrap)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
