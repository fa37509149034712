"""Where a first ``make repro`` spends its time, stage by stage, side by side with a baseline revision.

    python -m benchmarks.repro_profile --baseline 1cb7be3                      # the default stages, 2 runs a side
    python -m benchmarks.repro_profile --baseline 1cb7be3 --stages backbone --repeats 1

Run it in a workspace whose stage outputs exist (after ``make repro``). Each side is a scratch git worktree under
``--work`` at its revision (the candidate: HEAD), given copies of the chosen stages' DVC-tracked inputs from this
workspace, so both sides start from the same data. Each stage command (as dvc.yaml resolves it, run the way DVC runs
it, with that tree's code first on the import path) runs A/B alternately, with an empty prefix cache as on a first
``make repro``. Per run: the process's wall time and its stage record (``reports/timing/<stage>.json``: start-up =
interpreter + imports + arguments, work, peak RSS); the rest of the wall time is the process's exit. Model loading
is timed on its own, in a fresh process per side (``models/backbone`` through transformers). Writes
``reports/bench/repro.md`` and ``repro.json``: medians per side and candidate / baseline ratios, which hold across
machines where absolute times do not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_STAGES = (
    "partition@domain-0",
    "postag",
    "train@fedavg-domain",
    "train@fedselectkd-domain",
    "evaluate@fedavg-domain",
)
LOAD_PROBE = (
    "import time; t = time.perf_counter(); "
    "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer; i = time.perf_counter(); "
    "AutoModelForSeq2SeqLM.from_pretrained('models/backbone'); "
    "AutoTokenizer.from_pretrained('models/backbone'); print(i - t, time.perf_counter() - i)"
)


def stages_by_name(root: Path) -> dict:
    from dvc.repo import Repo

    return {s.addressing: s for s in Repo(str(root)).index.stages}


def tracked_inputs(stage, outputs: set[str]) -> list[str]:
    """The stage's dependencies that another stage writes (code and params come with the git revision)."""
    return [
        d.def_path for d in stage.deps if d.def_path in outputs or any(d.def_path.startswith(o + "/") for o in outputs)
    ]


def prepare(rev: str, tree: Path, inputs: list[str]) -> None:
    if tree.exists():
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), rev], cwd=ROOT, check=True)
    for rel in inputs:
        src, dst = ROOT / rel, tree / rel
        if not src.exists():
            raise SystemExit(f"{src}: missing stage input (run `make repro` first)")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dst, ignore_errors=True) if dst.is_dir() else dst.unlink(missing_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)


def environment(tree: Path) -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=str(tree),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        FLWR_TELEMETRY_ENABLED="0",
        MLFLOW_ENABLE_TELEMETRY="false",
    )


def run_stage(tree: Path, name: str, cmd: str) -> dict[str, float]:
    shutil.rmtree(tree / "data/cache", ignore_errors=True)  # a first `make repro`: no prefix cache yet
    timing = tree / "reports/timing"
    shutil.rmtree(timing, ignore_errors=True)  # the record this run writes is then the only one
    start = time.perf_counter()
    out = subprocess.run(cmd, shell=True, cwd=tree, env=environment(tree), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{tree}: `{cmd}` failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    written = sorted(timing.glob("*.json"))
    if len(written) != 1:
        raise SystemExit(f"{tree}: `{cmd}` wrote {len(written)} timing records, expected 1")
    record = json.loads(written[0].read_text())
    return {
        "wall_seconds": wall,
        "startup_seconds": record["startup_seconds"],
        "work_seconds": record["seconds"],
        "exit_seconds": wall - record["startup_seconds"] - record["seconds"],
        "peak_rss_mb": record["peak_rss_mb"],
    }


def load_probe(tree: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", LOAD_PROBE], cwd=tree, env=environment(tree), capture_output=True, text=True, check=True
    )
    imports, load = map(float, out.stdout.split()[-2:])
    return {"transformers_import_seconds": imports, "model_load_seconds": load}


def median_parts(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def markdown(result: dict) -> str:
    lines = [
        f"# `make repro` stage profile: {result['candidate']} against {result['baseline']}",
        "",
        f"Measured {result['measured_at']} on {result['machine']}, by `python -m benchmarks.repro_profile` "
        f"({result['repeats']} run(s) a side, A/B alternated, empty prefix cache). Medians; ratio = candidate / "
        "baseline (below 1: faster or smaller).",
        "",
        "| stage | part | baseline | candidate | ratio |",
        "|---|---|---|---|---|",
    ]
    for name, sides in result["stages"].items():
        for part in sides["baseline"]:
            a, b = sides["baseline"][part], sides["candidate"][part]
            lines.append(
                f"| {name} | {part} | {a:.2f} | {b:.2f} | {b / a:.2f} |"
                if a > 0 and b >= 0  # a ratio of residuals below zero (rounding) would invert its reading
                else f"| {name} | {part} | {a:.2f} | {b:.2f} | - |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the revision to compare against (e.g. the main you began from)")
    ap.add_argument("--candidate", default="HEAD")
    ap.add_argument("--stages", nargs="+", default=list(DEFAULT_STAGES), help="DVC stage names (dvc stage list)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fedmeet-repro-profile"))
    ap.add_argument("--out", type=Path, default=ROOT / "reports/bench")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    stages = stages_by_name(ROOT)
    unknown = [s for s in args.stages if s not in stages]
    if unknown:
        raise SystemExit(f"unknown stage(s) {unknown}; dvc.yaml has {sorted(stages)}")
    outputs = {str(o.def_path) for s in stages.values() for o in s.outs}
    inputs = sorted({p for s in args.stages for p in tracked_inputs(stages[s], outputs)})
    sides = {"baseline": args.baseline, "candidate": args.candidate}
    trees = {side: args.work / side for side in sides}
    for side, rev in sides.items():
        prepare(rev, trees[side], inputs)
    runs: dict[str, dict[str, list]] = {s: {side: [] for side in sides} for s in ["model load", *args.stages]}
    with tqdm(total=args.repeats * len(sides) * (len(args.stages) + 1), desc="repro profile", unit="run") as bar:
        for r in range(args.repeats):
            for side in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                runs["model load"][side].append(load_probe(trees[side]))
                bar.update()
                for name in args.stages:
                    runs[name][side].append(run_stage(trees[side], name, stages[name].cmd))
                    bar.update()
    result = {
        "baseline": args.baseline,
        "candidate": args.candidate,
        "repeats": args.repeats,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "stages": {name: {side: median_parts(v) for side, v in by_side.items()} for name, by_side in runs.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "repro.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "repro.md").write_text(markdown(result))
    for tree in trees.values():
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    print(f"wrote {args.out / 'repro.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
