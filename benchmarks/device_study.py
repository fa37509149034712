"""Run a preset's backbone, train and evaluate stages on a machine that has a GPU but no DVC or network.

The CPU study (configs/cpu-study.yaml) takes hours on 2 cores and minutes on one GPU. A lent GPU machine here has
PyTorch and transformers but no DVC, MLflow or network, so this runner executes the same stage commands that
dvc.yaml runs (``python -m pipeline.backbone``, ``pipeline.train --experiment E``, ``pipeline.evaluate run
--experiment E``) in a copy of the workspace whose params.yaml is the preset applied to params.yaml and whose
upstream outputs (data/interim/samsum.parquet, data/processed/examples.parquet, data/partitions, models/plans) were
made by the DVC pipeline on the CPU machine. MLflow logging is off there (``--no-mlflow``); the reports come back
and the analyze and report stages run where DVC is.

    python benchmarks/device_study.py backbone --variant random:cross_attention_init=random ...
    python benchmarks/device_study.py train --parallel 6 [--experiments a b ...]
    python benchmarks/device_study.py pack --out $OUT

Determinism: every stage runs with ``torch.use_deterministic_algorithms(True, warn_only=True)`` and
``CUBLAS_WORKSPACE_CONFIG=:4096:8``, so the same seed on the same GPU model gives the same backbone and adapters.
Finished experiments (reports/eval/<exp>/metrics.json present) are skipped, so a lost machine costs only the
experiments in flight. Wall time of every part goes to reports/timing/device-study.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TIMING = Path("reports/timing/device-study.json")
# Runs a stage module with PyTorch's deterministic algorithms (embedding backward and scatter ops otherwise use
# atomics on CUDA and differ from run to run).
DETERMINISTIC = (
    "import runpy, sys, torch; torch.use_deterministic_algorithms(True, warn_only=True); "
    "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


def _env(threads: int) -> dict[str, str]:
    env = dict(
        os.environ,
        CUBLAS_WORKSPACE_CONFIG=":4096:8",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_stage(module: str, args: list[str], log: Path, threads: int = 2) -> float:
    """One stage command (as dvc.yaml has it), its output in ``log``; returns its wall time; raises on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as fh:
        code = subprocess.call(
            [sys.executable, "-c", DETERMINISTIC, module, *args],
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=_env(threads),
        )
    if code != 0:
        raise RuntimeError(f"{module} {' '.join(args)} exited {code}; see {log}")
    return round(time.perf_counter() - t0, 1)


def record_time(key: str, seconds: float) -> None:
    timing = json.loads(TIMING.read_text()) if TIMING.is_file() else {}
    timing[key] = seconds
    TIMING.parent.mkdir(parents=True, exist_ok=True)
    TIMING.write_text(json.dumps(timing, indent=2, sort_keys=True) + "\n")


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------------ backbone
def backbone(variants: list[str], choose_from: list[str], parallel: int) -> dict:
    """Build one backbone per variant (``name:key=value,...`` over backbone.warmup) side by side, then copy the
    variant with the highest SAMSum validation ROUGE-1 among ``choose_from`` to models/backbone."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    jobs = {}
    for spec in variants:
        name, _, sets = spec.partition(":")
        p = json.loads(json.dumps(params))
        for kv in filter(None, sets.split(",")):
            key, _, value = kv.partition("=")
            p["backbone"]["warmup"][key] = yaml.safe_load(value)
        path = ROOT / f"params-backbone-{name}.yaml"
        path.write_text(yaml.safe_dump(p, sort_keys=False))
        jobs[name] = path
    results: dict[str, dict] = {}
    with cf.ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {
            pool.submit(
                run_stage,
                "pipeline.backbone",
                [
                    "--params",
                    str(path),
                    "--out",
                    f"models/backbone-{name}",
                    "--report",
                    f"reports/backbones/{name}.json",
                ],
                Path(f"logs/backbone-{name}.log"),
                threads=max(1, (os.cpu_count() or 2) // parallel),
            ): name
            for name, path in jobs.items()
        }
        for fut in cf.as_completed(futures):
            name = futures[fut]
            seconds = fut.result()
            record_time(f"backbone-{name}", seconds)
            results[name] = json.loads((ROOT / f"reports/backbones/{name}.json").read_text())
            print(f"backbone {name}: ROUGE-1 {results[name]['evaluation']['rouge1']} in {seconds} s", flush=True)
    best = max(choose_from or list(results), key=lambda n: results[n]["evaluation"]["rouge1"])
    shutil.rmtree(ROOT / "models/backbone", ignore_errors=True)
    shutil.copytree(ROOT / f"models/backbone-{best}", ROOT / "models/backbone")
    shutil.copy(ROOT / f"reports/backbones/{best}.json", ROOT / "reports/backbone.json")
    summary = {
        "device": device_name(),
        "chosen": best,
        "chosen_among": choose_from or sorted(results),
        "variants": {
            n: {
                "spec": next(v for v in variants if v.split(":")[0] == n),
                "rouge1": r["evaluation"]["rouge1"],
                "rouge2": r["evaluation"]["rouge2"],
                "rougeL": r["evaluation"]["rougeL"],
                "final_loss": r["warmup"]["final_loss"],
                "steps": r["warmup"]["steps"],
                "seconds": r["warmup"]["seconds"],
                "backbone_sha256": r["backbone_sha256"],
            }
            for n, r in sorted(results.items())
        },
    }
    Path("reports/backbones/summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"chosen backbone: {best}", flush=True)
    return summary


# ------------------------------------------------------------------------------------------------ train + evaluate
def experiment(name: str, threads: int) -> dict[str, float]:
    if (ROOT / f"reports/eval/{name}/metrics.json").is_file():
        return {}
    times = {
        "train": run_stage(
            "pipeline.train", ["--experiment", name, "--no-mlflow"], Path(f"logs/train-{name}.log"), threads
        )
    }
    times["evaluate"] = run_stage(
        "pipeline.evaluate", ["run", "--experiment", name, "--no-mlflow"], Path(f"logs/evaluate-{name}.log"), threads
    )
    return times


def train(experiments: list[str], parallel: int) -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    names = experiments or list(params["experiments"])
    threads = max(1, (os.cpu_count() or 2) // parallel)
    failed = []
    with cf.ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {pool.submit(experiment, n, threads): n for n in names}
        for fut in cf.as_completed(futures):
            name = futures[fut]
            try:
                times = fut.result()
            except RuntimeError as err:
                failed.append(name)
                print(f"FAILED {name}: {err}", flush=True)
                continue
            for part, seconds in times.items():
                record_time(f"{part}-{name}", seconds)
            print(f"done {name} {times or '(already finished)'}", flush=True)
    if failed:
        raise SystemExit(f"{len(failed)} experiment(s) failed: {failed}")


# ------------------------------------------------------------------------------------------------ pack
def pack(out: Path, first: int = 0, part_bytes: int = 15 * 2**20, max_parts: int = 8) -> list[Path]:
    """Reports, gate logs and logs as tar.xz parts of at most ``part_bytes`` of input each (a device call returns at
    most 8 files of 16 MiB); parts ``first`` .. ``first + max_parts - 1`` are written. Adapters stay on the machine
    (their hashes are in the train reports)."""
    files = sorted(
        [
            p
            for d in ("reports/train", "reports/eval", "reports/backbones", "logs")
            for p in (ROOT / d).rglob("*")
            if p.is_file()
        ]
        + [ROOT / "reports/backbone.json", ROOT / TIMING]
        + list((ROOT / "models").glob("*/gate_log.parquet"))
    )
    parts: list[list[Path]] = [[]]
    size = 0
    for f in (f for f in files if f.is_file()):
        n = f.stat().st_size
        if parts[-1] and size + n > part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(f)
        size += n
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for i in range(first, min(len(parts), first + max_parts)):
        path = out / f"results-{i}.tar.xz"
        with tarfile.open(path, "w:xz") as tar:
            for f in parts[i]:
                tar.add(f, arcname=str(f.relative_to(ROOT)))
        written.append(path)
        print(f"{path.name}: {len(parts[i])} files, {path.stat().st_size / 2**20:.1f} MiB", flush=True)
    print(f"{len(parts)} part(s) in all", flush=True)
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("backbone")
    b.add_argument("--variant", action="append", required=True, help="name:key=value,... over backbone.warmup")
    b.add_argument("--choose-from", nargs="*", default=[], help="variants eligible for models/backbone (default all)")
    b.add_argument("--parallel", type=int, default=4)
    t = sub.add_parser("train")
    t.add_argument("--experiments", nargs="*", default=[])
    t.add_argument("--parallel", type=int, default=6)
    p = sub.add_parser("pack")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--first", type=int, default=0, help="first part to write (8 at most per call)")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    if args.command == "backbone":
        backbone(args.variant, args.choose_from, args.parallel)
    elif args.command == "train":
        train(args.experiments, args.parallel)
    else:
        pack(args.out, args.first)


if __name__ == "__main__":
    main()
