"""Here, after the device call: its returned files into ``reports/gpu-study/`` and the MLflow store.

    python -m tools.gpu_study.importer DIR [--dest reports/gpu-study]

``DIR`` holds what ``tools.gpu_study.device run`` wrote under $OUT (study.json, log.tar.gz, results.tar.gz, the
last two possibly cut into ``.partN`` pieces). The import

1. unpacks them and lays the study out as reports/cpu-study is laid out: ``params.yaml`` (the profile merged),
   ``backbone.json``, ``plans/``, ``train/<exp>/``, ``eval/<exp>/``, ``timing/``, ``data/`` and, in ``device/``,
   study.json (steps and seconds), log.tar.gz (the stages' log, the nvidia-smi samples) and the md5 of every weights
   file the run wrote (the backbone and adapters stay on the machine: ~197 MB + ~28 MB a run do not fit what a call
   returns). The gate logs stay out (they hold client token ids);
2. logs each experiment's training into the MLflow store (pipeline.results.tracking: its plan as params, every round,
   the closing metrics and convergence tags, its records as artifacts) and then its evaluation into that run
   (pipeline.results.evaluation.log_to_mlflow, as the evaluate stage does); each run once, whichever call's files
   bring it (an earlier import of a cut call's: only the evaluation it lacked is added);
3. writes the tables, ``comparisons.csv`` and the learning curves with the report stage's ``rebuild``
   (pipeline.report.rebuild_study) and a README whose facts (device, wall time per step, runs trained, converged and
   evaluated) come from the files, then removes the generated summaries (``eval/<exp>/predictions.jsonl``; they
   stay in the returned archive).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from tools.gpu_study.device import REPO


def archives(folder: Path) -> dict[str, bytes]:
    """name -> bytes of each returned tar.gz, its ``.partN`` pieces joined in order."""
    pieces: dict[str, list[tuple[int, Path]]] = {}
    for f in folder.iterdir():
        m = re.fullmatch(r"(.+\.tar\.gz)(?:\.part(\d+))?", f.name)
        if m:
            pieces.setdefault(m.group(1), []).append((int(m.group(2) or 0), f))
    return {name: b"".join(p.read_bytes() for _, p in sorted(parts)) for name, parts in pieces.items()}


# where each returned path goes in the study folder (first match); None: left out
LAYOUT = (
    (r"params\.yaml", "params.yaml"),
    (r"reports/backbone\.json", "backbone.json"),
    (r"models/plans/(.+)", r"plans/\1"),
    (r"reports/(train|eval|timing)/(.+)", r"\1/\2"),
    (r"reports/data/(stats\.(json|md))", r"data/\1"),
    (r"(?:reports|data)/partitions/(.+)", r"partitions/\1"),
    (r"weights\.md5\.json", "device/weights.md5.json"),
    (r"models/[^/]+/gate_log\.parquet", None),
    (r"models/([^/]+)/(experiment|metrics|rounds)\.json", r"runs/\1/\2.json"),
)


def place(name: str) -> str | None:
    for pattern, target in LAYOUT:
        if re.fullmatch(pattern, name):
            return None if target is None else re.sub(pattern, target, name)
    return None


def first_start(study: dict[str, Any]) -> float | None:
    """When the study's first call started its first step: the same in each later call's study.json (which keeps
    the earlier calls' records) and in a detached study's snapshot, another in another study's."""
    steps = [*study.get("earlier_calls", []), study][0].get("steps") or [{}]
    return steps[0].get("started_at")


def unpack(returned: Path, dest: Path) -> dict[str, Any]:
    """The returned files into ``dest``; returns study.json's content."""
    study = json.loads((returned / "study.json").read_text())
    found = archives(returned)
    if "results.tar.gz" not in found:
        raise SystemExit(f"{returned}: results.tar.gz missing (the files of `python -m tools.gpu_study.device run`)")
    with tarfile.open(fileobj=io.BytesIO(found["results.tar.gz"])) as tar:  # the install or workspace step failed
        if "params.yaml" not in tar.getnames():
            raise SystemExit(
                f"{returned}: no params.yaml in results.tar.gz: the call stopped before its workspace; see study.json"
            )
    old = dest / "device/study.json"
    if old.is_file() and first_start(json.loads(old.read_text())) != first_start(study):
        # another study's import (an earlier lease's): replaced whole, not merged with this one's files (its runs and
        # evaluations would be counted and tabled as this study's); a later call of the same study brings them all
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "device").mkdir(exist_ok=True)
    shutil.copy(returned / "study.json", dest / "device/study.json")
    if "log.tar.gz" in found:  # packed as it came (0.1 MiB; the stages' output and py-spy's samples unpack to ~2)
        (dest / "device/log.tar.gz").write_bytes(found["log.tar.gz"])
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(fileobj=io.BytesIO(found["results.tar.gz"])) as tar:
        tar.extractall(tmp, filter="data")
        for f in sorted(Path(tmp).rglob("*")):
            target = place(f.relative_to(tmp).as_posix()) if f.is_file() else None
            if target:
                (dest / target).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, dest / target)
    return study


IMPORTED = "gpu_study.record"  # a run's tag: the sha256 of the run records it was imported from
EVALUATED = "gpu_study.evaluation"  # and of the evaluation logged into it


def digest(*files: Path) -> str:
    return hashlib.sha256(b"\0".join(f.read_bytes() for f in files)).hexdigest()


def log_runs(dest: Path, device: str) -> list[str]:
    """Each experiment's training and evaluation into the MLflow store, each run once however many calls' files
    bring it (tags :data:`IMPORTED`, :data:`EVALUATED`); returns the run ids."""
    from pipeline.common.config import from_dict, load_params
    from pipeline.experiments.plans import read_plan
    from pipeline.results.evaluation import EvaluateConfig, log_to_mlflow
    from pipeline.results.readers import run_converged
    from pipeline.results.tracking import RunLogger, delete_run, experiment_id, find_runs, run_name
    from pipeline.train import run_tags
    from pipeline.training.history import log_missing_rounds
    from pipeline.training.summary import convergence_tags, final_run_metrics

    params = load_params(dest / "params.yaml")
    cfg = from_dict(EvaluateConfig, params.get("evaluate"), "evaluate")
    ids = []
    for run_dir in sorted((dest / "runs").glob("*")):  # none when every run was cut before it finished
        plan = read_plan(run_dir / "experiment.json")
        record = digest(*sorted(run_dir.glob("*.json")))
        # a run that finished in a cut call comes back unchanged with the resumed call's files: imported once
        exp_id = experiment_id(plan.study)
        found = find_runs(exp_id, f"tags.`{IMPORTED}` = '{record}'")
        tags = found[0].data.tags if found else {}
        if not found:
            # a run an import of these files was cut in (imported from here, no record tag: not all in) is deleted
            # with its clients' runs and logged anew, not left beside the new one; runs imported from elsewhere stay
            for run in find_runs(exp_id, f"tags.experiment = '{plan.experiment}' and tags.imported_from LIKE '%'"):
                if IMPORTED not in run.data.tags and run.data.tags["imported_from"] == str(dest):
                    delete_run(run.info.run_id)
            logger = RunLogger.start(
                plan.study,
                run_name(plan.experiment),
                plan.to_json_dict(),
                run_tags(plan) | {"device": device, "imported_from": str(dest)},
                partition=dest / "partitions" / f"{plan.partition}.json",
            )
            metrics = json.loads((run_dir / "metrics.json").read_text())
            log_missing_rounds(logger, json.loads((run_dir / "rounds.json").read_text()))
            logger.log_metrics(final_run_metrics(metrics), step=metrics["stopped_round"])
            logger.set_tags(convergence_tags(metrics))
            for f in sorted(run_dir.glob("*.json")):
                logger.log_artifact(f)
            logger.finish("FINISHED")
            logger.set_tags({IMPORTED: record})  # last: a run cut mid-import (no tag) is imported again
        run_id = found[0].info.run_id if found else logger.run_id
        eval_dir = dest / "eval" / plan.experiment
        evaluated = digest(eval_dir / "metrics.json") if (eval_dir / "metrics.json").is_file() else None
        if evaluated not in (None, tags.get(EVALUATED)):  # into this run, once (the cut call may have had none)
            evaluation = json.loads((eval_dir / "metrics.json").read_text())
            converged = run_converged(dest / "train", plan.experiment)
            log_to_mlflow(plan.to_json_dict() | {"mlflow_run_id": run_id}, evaluation, eval_dir, cfg, converged)
            RunLogger(run_id).set_tags({EVALUATED: evaluated})
        ids.append(run_id)
    return ids


def readme(dest: Path, study: dict[str, Any]) -> str:
    """The study's README: where and how it ran (from study.json), and the claims block the rebuild fills."""
    from pipeline.results import claims

    gpu = study["device"].get("gpu") or "no GPU (CPU)"
    calls = [*study.get("earlier_calls", []), study]  # a resumed call keeps the earlier ones' records
    trained = sorted(f.parent.name for f in (dest / "runs").glob("*/metrics.json"))
    converged = [e for e in trained if json.loads((dest / "runs" / e / "metrics.json").read_text()).get("converged")]
    unevaluated = [e for e in trained if not (dest / "eval" / e / "metrics.json").is_file()]
    runs = (
        f"{len(trained)} runs finished training ({len(converged)} converged by the stop rule of `train.stop`) and "
        f"{len(trained) - len(unevaluated)} were evaluated"
        + (f" (not evaluated: {', '.join(unevaluated)})" if unevaluated else "")
    )
    rows = "".join(
        f"| {s['step']} | {s['status']} | {s.get('seconds', '')} | {n} |\n"
        for n, call in enumerate(calls, start=1)
        for s in call["steps"]
    )
    return (
        f"# The gpu-study profile ({study['profile']}), run on a lent machine\n\n"
        f"Device: {gpu}; Python {study['device']['python']}. The script (`tools/gpu_study/device.py`) ran "
        f"{len(calls)} call(s) on one machine, {sum(c['seconds'] for c in calls):.0f} s of their "
        f"{sum(c['budget_s'] for c in calls):.0f} s budgets in all, and "
        f"{'completed every step' if study['complete'] else 'did NOT complete (see the steps)'}: {runs}. It ran the "
        f"stages of dvc.yaml in their order without DVC; the backbone and adapters stayed on the machine (their md5 are "
        f"in `device/weights.md5.json`). Imported here by `python -m tools.gpu_study.importer`, which logged every "
        f"run into the MLflow store and wrote the tables with `python -m pipeline.report rebuild`.\n\n"
        "What travelled there: the checkout's working tree and the carry `python -m tools.gpu_study.prepare` built "
        "(the wheels the image lacks, the float32 MiniLM weights packed losslessly, the raw datasets); what came "
        "back: study.json, the stages' log with the GPU samples, and the run records, plans and reports (no weights). "
        "What differs from a CPU run of the same stages: the device's kernels (a run's numbers need not be bit-identical "
        "to a CPU run's), the runs of a set trained together in one process (a run computes the same in any set: "
        "tests/test_run_set.py), and each set's runs evaluated together, their adapters stacked in the same generate "
        "calls at the profile's `evaluate.batch_size` (the same scores as alone: tests/test_evaluate.py).\n\n"
        f"| step | status | seconds | call |\n|---|---|---|---|\n{rows}\n"
        f"{claims.BEGIN}\n{claims.END}\n"
    )


def import_study(returned: Path, dest: Path) -> dict[str, Any]:
    from pipeline.report import rebuild_study

    study = unpack(returned, dest)
    ids = log_runs(dest, study["device"].get("gpu") or "cpu")
    (dest / "README.md").write_text(readme(dest, study))
    made = rebuild_study(dest)
    # the generated summaries (~0.16 MiB a run) stay out, as reports/cpu-study's do (the working tree travels with
    # each device call); they are in the call's results.tar.gz, which call_report keeps. The rebuild has put their
    # identical fractions into comparisons.csv, where a later rebuild takes them from (pipeline.results.comparisons)
    for f in (dest / "eval").glob("*/predictions.jsonl"):
        f.unlink()
    return {"mlflow_runs": ids, "complete": study["complete"]} | made


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("returned", type=Path, help="the folder of the files the device call returned")
    ap.add_argument("--dest", type=Path, default=REPO / "reports/gpu-study")
    args = ap.parse_args(argv)
    print(json.dumps(import_study(args.returned, args.dest), indent=1))


if __name__ == "__main__":
    main()
