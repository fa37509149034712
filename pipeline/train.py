"""Stage `train`: one experiment (a DVC `foreach` over params.yaml `experiments`) from its plan file.

    python -m pipeline.train --experiment fedselectkd-domain
    python -m pipeline.train --experiment A --experiment B   # several, as one set trained together in one process

Its outputs, and the run directory a killed run resumes from: docs/ARCHITECTURE.md ("Training and federation").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Any

from pipeline.common import atomic, cli
from pipeline.common.timing import stage_name, stage_timer
from pipeline.experiments.plans import Plan, read_plan, record_hash
from pipeline.experiments.settings import RunSettings, load_run_settings
from pipeline.federation.engines import run_federated
from pipeline.paths import PATHS
from pipeline.privacy import seam as privacy
from pipeline.results.tracking import RunLogger, delete_run, dvc_tags, git_state, run_name
from pipeline.training import checkpoints, set_engine
from pipeline.training.history import ROUND_METRIC, TrainRecorder, log_missing_rounds
from pipeline.training.serverless import run_serverless
from pipeline.training.summary import log_run_outputs, merge_gate_logs, prepare_outputs, record_run, run_identity_tags


def run_tags(plan: Plan) -> dict[str, str]:
    """Tags of the experiment's MLflow run: what it is, and where it came from (commit, dirty tree, DVC experiment,
    plan hash), so a run can be matched to its `dvc exp show` row."""
    tags = run_identity_tags(plan, "inprocess" if plan.spec.federated else "none") | {"plan_hash": plan.hash}
    return tags | git_state() | dvc_tags()


def run_experiment(plan_path: str | Path, *, track: bool = True, settings: RunSettings | None = None) -> dict[str, Any]:
    """Train one experiment end to end (resuming when a checkpoint of this plan exists); returns metrics.
    ``settings``: how to run it (:func:`main` passes the params file's; None: RunSettings' defaults). In a set
    (:func:`run_set`), its clients' work executes at the set's round barrier."""
    plan = read_plan(plan_path)
    privacy.check_run(plan)  # a delta or target no client can meet: one line, exit 2, before anything trains
    settings = settings if settings is not None else RunSettings()
    out_dir = Path(plan.paths["out_dir"])
    if out_dir.exists() and not checkpoints.has_valid_checkpoint(plan):
        if track and (run_id_file := checkpoints.mlflow_run_id_path(plan)).exists():  # killed before a checkpoint
            with contextlib.suppress(Exception):  # its run, unless it logged a round (or is gone: another store)
                delete_run(run_id_file.read_text().strip(), unless_logged=ROUND_METRIC)
        # this plan's client-level DP releases (round 1's leave before its checkpoint) are redone afresh, counted again
        releases, record = checkpoints.checkpoint_dir(plan) / checkpoints.DP_RELEASES, out_dir / "experiment.json"
        try:
            ours = releases.exists() and record.exists() and record_hash(json.loads(record.read_text())) == plan.hash
        except ValueError as err:  # whose releases they are cannot be read: counted again, never left out
            logging.getLogger(__name__).warning(
                "%s: unreadable (%s); its client-level DP releases are kept", record, err
            )
            ours = True
        kept = releases.read_text() if ours else None
        shutil.rmtree(out_dir)  # outputs of another configuration or a finished run: start clean
        if kept is not None:
            atomic.write_text(releases, kept)
    prepare_outputs(plan)

    logger = None
    if track:
        # The run id lives beside the checkpoint: a resumed training continues its MLflow run.
        logger = RunLogger.start(
            plan.study,
            run_name(plan.experiment),
            plan.to_json_dict(),
            run_tags(plan),
            checkpoints.mlflow_run_id_path(plan),
            partition=plan.paths["partition"],
        )

    recorder = TrainRecorder(logger)
    try:
        if plan.spec.federated:
            history = run_federated(str(plan_path), settings, recorder)
        else:
            history = run_serverless(plan, recorder, settings.cache)
        merge_gate_logs(plan)
        metrics = record_run(plan, history, recorder.round_seconds)
        if logger is not None:
            log_missing_rounds(logger, history)
            # Adapters and summaries only: the gate log holds client token ids and stays out of the tracking store.
            adapters = [
                (f, f"adapters/{f.parent.name}") for f in sorted(out_dir.glob("clients/*/adapter_*.safetensors"))
            ]
            log_run_outputs(logger, plan, metrics, adapters, None)  # each client's best adapter as a LoggedModel
            logger.finish("FINISHED")
    except BaseException:  # also while the finished run is recorded and uploaded
        if logger is not None:
            logger.finish("KILLED")  # resumable: the rerun reopens this run
        raise
    finally:
        recorder.close()
    checkpoints.publish_outputs(plan)
    # Published: the run directory (checkpoint, per-round gate logs) goes. A run killed before this line resumes
    # after its last round from the checkpoint and publishes again.
    shutil.rmtree(out_dir)
    return metrics


def run_set(
    plan_paths: list[Path], track: bool = True, settings: dict[str, RunSettings] | None = None
) -> dict[str, dict[str, Any]]:
    """Train the experiments of ``plan_paths`` as one set in this process (pipeline.training.set_engine): each in its
    own thread and round loop, their clients' work at one round barrier, each computing what it would alone in a
    fresh process; returns their metrics by experiment."""
    names = [Path(p).stem for p in plan_paths]
    with stage_timer(stage_name("train", names), experiments=names):
        return set_engine.run(
            {
                n: partial(run_experiment, p, track=track, settings=(settings or {}).get(n))
                for n, p in zip(names, plan_paths)
            }
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--experiment",
        required=True,
        action="append",
        help="a key of params.yaml `experiments`; repeated: several, trained together as one set",
    )
    ap.add_argument("--plans", default=str(PATHS.plans), help="directory of the plan files (stage `plan`)")
    ap.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    cli.add_params(ap, "params file of the run-time settings (round timeout, cache location and budgets)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # SIGTERM (a scheduler's or `kill`'s stop) unwinds like Ctrl-C, so the MLflow run is closed as KILLED at once
    # (SIGKILL cannot be caught: the next start of the experiment closes that run).
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        paths = [Path(args.plans) / f"{e}.json" for e in args.experiment]
        for path in paths:
            read_plan(path)  # a bad plan is reported before anything else is read
        results = run_set(
            paths, track=not args.no_mlflow, settings={e: load_run_settings(args.params, e) for e in args.experiment}
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    for metrics in results.values():
        clients = metrics["clients"]
        print(json.dumps({c: {k: v[k] for k in ("best_round", "best_val_loss")} for c, v in clients.items()}))


if __name__ == "__main__":
    raise SystemExit(cli.run(main))
