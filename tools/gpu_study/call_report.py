"""What a GPU study call measured, finished or cut by its budget: reports/bench/engine.md's section 5.

    python -m tools.gpu_study.call_report DIR [--keep reports/bench/gpu-study-call] [--md reports/bench/engine.md]
        [--section 5]

``DIR`` holds the files ``tools.gpu_study.device run`` returned (study.json, log.tar.gz, results.tar.gz). They are
copied to ``--keep`` (the evidence, ~0.1 MiB; the log holds no client text) and the section is written from them:
each step's seconds; the training step's pace from every run's round bar in the log (seconds per round of the set,
each run advancing one round); GPU utilisation and memory over the training from the nvidia-smi samples; and, per
arm, how far the runs were from the stop rule of ``train.stop`` when the call ended, with the round the rule would
hold if each run's curve goes on as the power law fitted to it (``benchmarks.stop_rule.projected_stop``; its
error on the last rounds it did not see says how far to trust it).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import statistics
import tarfile
import tempfile
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from benchmarks.gpu_profile import pyspy_top, read_smi, replace_section
from tools.gpu_study.device import RESERVE_S
from tools.gpu_study.estimate import H100_PEAK, client_counts, floor_flops_per_round
from tools.gpu_study.importer import REPO, archives

HOLDOUT = 3  # rounds each run's power law does not see, to show its error


def _members(blob: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def round_ends(log: str) -> dict[str, dict[int, int]]:
    """run -> {rounds done: seconds since the run's start}, the first time its tqdm bar showed each count."""
    ends: dict[str, dict[int, int]] = defaultdict(dict)
    for m in re.finditer(r"([\w.-]+) rounds:\s+\d+%\|[^|]*\|\s*(\d+)/\d+ \[(?:(\d+):)?(\d+):(\d+)", log):
        seconds = 3600 * int(m.group(3) or 0) + 60 * int(m.group(4)) + int(m.group(5))
        ends[m.group(1)].setdefault(int(m.group(2)), seconds)
    return dict(ends)


def train_windows(calls: list[dict[str, Any]], log: str, t0: float | None) -> list[tuple[float, float]]:
    """(start, end) in unix seconds of each call's train step: from its recorded ``started_at``, or, for a single
    call without it, from its ``=== train (N s left)`` line (the budget less the packing reserve, less N, after
    ``t0``: the first nvidia-smi sample, taken as the call starts)."""
    windows = [
        (s["started_at"], s["started_at"] + s["seconds"])
        for call in calls
        for s in call["steps"]
        if s["step"].startswith("train") and "started_at" in s and "seconds" in s  # not one a killed call left running
    ]
    m = re.search(r"^=== train \((\d+) s left\)$", log, re.M)
    if windows or len(calls) > 1 or t0 is None or not m:
        return windows
    seconds = next(s["seconds"] for s in calls[0]["steps"] if s["step"] == "train")
    start = t0 + calls[0]["budget_s"] - RESERVE_S - int(m.group(1))
    return [(start, start + seconds)]


def arm_of(experiment: str) -> str:
    return re.sub(r"-s\d+$", "", experiment)


def convergence_rows(rounds: dict[str, list[dict[str, Any]]], stop) -> list[dict[str, Any]]:
    """Per arm: rounds reached, validation loss at round 1 and at the last, the last round's relative improvement,
    runs the rule called converged, and the power law's projected stop round and holdout error (over seeds)."""
    from benchmarks.stop_rule import projected_stop
    from pipeline.training.stopping import plateaued, relative_improvements

    by_arm: dict[str, list[str]] = defaultdict(list)
    for exp in sorted(rounds):
        by_arm[arm_of(exp)].append(exp)
    rows = []
    for arm, exps in by_arm.items():
        # None: a round without a client average, the stop rule's NaN (training.history.round_values)
        series = {
            e: [float("nan") if r["val_loss_mean"] is None else r["val_loss_mean"] for r in rounds[e]] for e in exps
        }
        projections = [  # a power law has 3 parameters: fitted on at least 3 rounds besides the held-out ones
            projected_stop(list(range(1, len(s) + 1)), s, stop, fit_rounds=len(s) - HOLDOUT)
            for s in series.values()
            if len(s) >= HOLDOUT + 3
        ]
        gains = [relative_improvements(s)[-1] for s in series.values() if len(s) > 1]  # none for a lone first round
        rows.append(
            {
                "arm": arm,
                "runs": len(exps),
                "rounds": sorted({len(s) for s in series.values()}),
                "first": statistics.mean(s[0] for s in series.values()),
                "last": statistics.mean(s[-1] for s in series.values()),
                "last_gain": statistics.mean(gains) if gains else None,
                "converged": sum(plateaued(s, stop.min_rel_improvement, stop.patience) for s in series.values()),
                "projected": [p["stop_round"] for p in projections],
                "holdout": max((p["holdout_error"] for p in projections), default=None),
            }
        )
    return rows


def floor_per_run_round(rounds: dict[str, list], params: dict[str, Any], partition: dict | None) -> dict[str, float]:
    """benchmarks/flops.py's floor (tools.gpu_study.estimate) of the run-rounds trained, per run-round, in seconds at
    the dense float32 and bfloat16 peaks; {} without the partition's sizes."""
    if not partition or not rounds:
        return {}
    n_train, n_valid = client_counts(partition)
    flops = {arm: floor_flops_per_round(n_train, n_valid, "kd" in arm, params) for arm in map(arm_of, rounds)}
    mean = sum(len(r) * flops[arm_of(e)] for e, r in rounds.items()) / sum(len(r) for r in rounds.values())
    return {dtype: mean / peak for dtype, peak in H100_PEAK.items()}


def markdown(
    study: dict[str, Any],
    log: str,
    smi: list,
    rounds: dict[str, list],
    params: dict[str, Any],
    spy: dict | None = None,
    floor: dict[str, float] | None = None,
    number: int = 5,
    kept: str = "reports/bench/gpu-study-call",
) -> str:
    from pipeline.common.config import from_dict
    from pipeline.experiments.train_config import StopConfig

    stop = from_dict(StopConfig, params["train"]["stop"], "train.stop")
    calls = [*study.get("earlier_calls", []), study]  # a resumed call keeps the earlier ones' records
    t0 = smi[0][0] if smi else None
    windows = train_windows(calls, log, t0)
    ends = round_ends(log)
    steps = "".join(
        f"| {s['step']} | {s['status']} | {s.get('seconds', '')} | {n} |\n"
        for n, call in enumerate(calls, start=1)
        for s in call["steps"]
    )
    # each run's rounds after its first from its bar; a resumed call's bar starts its clock again (a negative step)
    per_run = {
        run: [b - a for n, (a, b) in enumerate(zip(e.values(), list(e.values())[1:])) if n and b >= a]
        for run, e in ends.items()
    }
    durations = [d for ds in per_run.values() for d in ds]
    # every run advances a round per its median round; runs whose bar tqdm hid at the median of those shown
    medians = [statistics.median(ds) for ds in per_run.values() if ds]
    paces = medians + [statistics.median(medians)] * (len(rounds) - len(medians)) if medians else []
    # (a bar counts whole seconds: rounds under one second leave the pace unknown)
    per_run_round = 1 / sum(1 / p for p in paces) if paces and min(paces) > 0 else float("nan")
    first = [e[1] for e in ends.values() if 1 in e]
    run_rounds = sum(len(r) for r in rounds.values())
    in_train = [(u, m) for t, u, m in smi if any(a <= t <= b for a, b in windows)]
    set_round = statistics.median(durations) if durations else float("nan")
    rows = convergence_rows(rounds, stop)
    table = "".join(
        f"| {r['arm']} | {r['runs']} | {'-'.join(map(str, r['rounds']))} | {r['first']:.3f} "
        f"| {r['last']:.3f} | {_number(r['last_gain'] and 100 * r['last_gain'], '.2f')} | {r['converged']} of {r['runs']} | "
        f"{', '.join(str(p) if p else f'>{stop.max_rounds}' for p in r['projected']) or '-'} | "
        f"{_number(r['holdout'], '.3f')} |\n"
        for r in rows
    )
    # the first call's train start: a step its killed call left running gives no window but has started_at
    starts = [s["started_at"] for s in calls[0]["steps"] if s["step"].startswith("train") and "started_at" in s]
    first_train = min(starts) if starts else windows[0][0] if windows else None
    before_train = first_train - t0 if first_train is not None and t0 else float("nan")
    projected = [p or stop.max_rounds for r in rows for p in r["projected"]]
    trained = all(s["status"] == "ok" for s in study["steps"] if s["step"].startswith("train"))
    util = [u for u, _ in in_train]
    return (
        f"## {number}. The GPU study's call on a lent GPU (`tools/gpu_study/device.py run`; "
        "`python -m tools.gpu_study.call_report`)\n\n"
        f"Device: {study['device'].get('gpu', 'none')}; Python {study['device']['python']}; "
        f"{f'{datetime.fromtimestamp(t0, UTC):%Y-%m-%d} (the first nvidia-smi sample)' if t0 else 'no nvidia-smi samples'}"
        f". configs/gpu-study.yaml's {len(rounds)} runs in {len(calls)} call(s) on one machine: "
        f"{sum(c['seconds'] for c in calls):.0f} s of their {sum(c['budget_s'] for c in calls):.0f} s budgets, "
        f"{'every step completed' if study['complete'] else 'not complete'}. The returned files are in "
        f"{kept}/.\n\n"
        f"| step | status | seconds | call |\n|---|---|---|---|\n{steps}\n"
        f"Training: the {len(rounds)} runs as {_sets(calls)} (`pipeline.train` with every experiment of a set), "
        f"{run_rounds} run-rounds "
        f"(their rounds.json){' to their stop' if trained else ' before the budget cut it'}. The round bars of "
        f"{len(ends)} runs are in the log (tqdm hides the rest below its rows); each of those runs' first round took "
        f"{min(first, default=0)}-{max(first, default=0)} s (the prefix cache filled); after it a round of the set "
        f"(every run one round) took {set_round:.1f} s (median of {len(durations)} rounds of the runs' bars; "
        f"{min(durations, default=0)}-{max(durations, default=0)} s), **{per_run_round:.2f} s per run-round** (the "
        "runs of a set meet at one barrier each round; sets in processes side by side add up)."
        + (
            f" benchmarks/flops.py's floor for these run-rounds at the study's maximum lengths (their matmul FLOPs "
            f"over the dense peak of an H100 or H200 SXM: {H100_PEAK['fp32'] / 1e12:.0f} TFLOP/s float32, "
            f"{H100_PEAK['bf16'] / 1e12:.0f} bfloat16) is {floor['fp32']:.3f} s a run-round in float32 and "
            f"{floor['bf16']:.4f} s in bfloat16: the pace is {per_run_round / floor['fp32']:.1f}x the one and "
            f"{per_run_round / floor['bf16']:.0f}x the other (the student runs under bf16 autocast, the teacher in "
            "float32)."
            if floor
            else ""
        )
        + " GPU over the training "
        f"step{_overlap(calls)}: utilisation "
        f"{_number(sum(util) / len(util) if util else None, '.1f')} % on average, {_share(util, lambda u: u <= 5)} % of the 2-s samples at or under 5 % and "
        f"{_share(util, lambda u: u >= 50)} % at or over 50 %; memory at most "
        f"{max((m for _, m in in_train), default=0):.0f} MiB. The steps before training took {before_train:.0f} s "
        "of the first call.\n\n"
        f"How far from converged {'at the end' if trained else 'at the cut'} (the stop rule: {stop.patience} rounds "
        f"each improving the best client-average validation loss by under {100 * stop.min_rel_improvement:g} %, at "
        f"most {stop.max_rounds} rounds; projected: the round where the rule holds on the power law fitted to each "
        f"run's rounds but its last {HOLDOUT}, whose largest error on those {HOLDOUT} is the holdout column, in "
        "nats):\n\n"
        "| arm | runs | rounds | val loss round 1 | val loss last | last round's gain % | converged | "
        "projected stop round per seed | holdout error |\n|---|---|---|---|---|---|---|---|---|\n"
        f"{table}\n"
        f"At this pace the projected stop rounds ({sum(projected)} run-rounds in all) would take "
        f"{sum(projected) * per_run_round:.0f} s of training, plus the first round's cache fill and "
        f"the {before_train:.0f} s before it, against one call's {calls[0]['budget_s']:.0f} s.\n"
    ) + (_spy_tables(spy) if spy and spy["samples"] else "")


def _sets(calls: list[dict[str, Any]]) -> str:
    """How the runs trained: one set, or sets in processes side by side (train@1, train@2, ...)."""
    n = len({s["step"] for call in calls for s in call["steps"] if s["step"].startswith("train@")})
    return f"{n} sets in processes side by side" if n else "one set"


def _overlap(calls: list[dict[str, Any]]) -> str:
    """What else the GPU did during the training windows: a finished set's evaluation beside the sets still training."""
    evaluated = any(s["step"].startswith("evaluate@") for call in calls for s in call["steps"])
    return " (with a finished set's evaluation beside the sets still training)" if evaluated else ""


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _spy_tables(spy: dict[str, Any]) -> str:
    """py-spy's view of the train step: where its busy threads were (own), and the project's functions they were in."""
    ours = [(f, c) for f, c in spy["within"] if "pipeline/" in f][:15]
    rows = lambda pairs: "".join(f"| `{f[:100]}` | {c} | {100 * c / spy['samples']:.0f} |\n" for f, c in pairs)  # noqa: E731
    return (
        f"\nWhere the train step's busy threads were (py-spy, 20 samples/s without pausing it, idle threads left "
        f"out: {spy['samples']} samples; own: the frame on top, inside torch's C++ included; within: anywhere in "
        "the stack, the project's functions):\n\n"
        f"| function (own) | samples | % |\n|---|---|---|\n{rows(spy['own'][:15])}\n"
        f"| function (within) | samples | % |\n|---|---|---|\n{rows(ours)}"
    )


def _share(values: list[float], keep) -> str:
    return f"{100 * sum(map(keep, values)) / len(values):.0f}" if values else "-"


def section(folder: Path, number: int = 5, kept: str = "reports/bench/gpu-study-call") -> str:
    """Section ``number`` from a folder of returned files, which ``kept`` names (its folder in the repo)."""
    study = json.loads((folder / "study.json").read_text())
    blobs = archives(folder)
    if missing := [n for n in ("log.tar.gz", "results.tar.gz") if n not in blobs]:
        raise SystemExit(f"{folder}: no {' nor '.join(missing)}: the call was cut before packing; see its study.json")
    logs, results = _members(blobs["log.tar.gz"]), _members(blobs["results.tar.gz"])
    if "params.yaml" not in results:  # the install or workspace step failed: nothing ran to report on
        raise SystemExit(
            f"{folder}: no params.yaml in results.tar.gz: the call stopped before its workspace; see study.json"
        )
    log = logs.get("log.txt", b"").decode(errors="replace").replace("\r", "\n")
    log = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", log)  # tqdm's cursor moves between the bars of the runs
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "gpu.csv").write_bytes(logs.get("gpu.csv", b""))
        stacks = b"".join(blob for name, blob in sorted(logs.items()) if re.fullmatch(r"pyspy-train.*\.txt", name))
        (Path(tmp) / "pyspy-train.txt").write_bytes(stacks)  # every train process's samples
        smi, spy = read_smi(Path(tmp) / "gpu.csv"), pyspy_top(Path(tmp) / "pyspy-train.txt", n=40)
    rounds = {
        name.split("/")[-2]: json.loads(blob)
        for name, blob in results.items()
        if re.fullmatch(r"reports/train/[^/]+/rounds\.json", name)
    }
    params = yaml.safe_load(results["params.yaml"])
    partitions = {p["partition"] for p in params["experiments"].values()}  # the study's: one
    blob = results.get(f"reports/partitions/{next(iter(partitions)).replace('/', '-')}.json")
    floor = floor_per_run_round(rounds, params, json.loads(blob) if blob and len(partitions) == 1 else None)
    return markdown(study, log, smi, rounds, params, spy, floor, number, kept)


def report(returned: Path, keep: Path, md: Path, number: int = 5) -> None:
    """Copy the returned files to ``keep`` and rewrite ``md``'s section ``number`` from them."""
    kept = keep.resolve()
    # first: files it refuses (a call cut before packing) leave the kept call as it was
    text = section(returned, number, kept.relative_to(REPO).as_posix() if kept.is_relative_to(REPO) else str(kept))
    if returned.resolve() != kept:
        keep.mkdir(parents=True, exist_ok=True)
        for f in keep.glob("*.tar.gz*"):  # an earlier call's archives and parts: joined with this call's otherwise
            f.unlink()
        for f in returned.iterdir():
            if f.is_file():
                shutil.copy(f, keep / f.name)
    replace_section(md, number, text, "The set engine (issue 53)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("returned", type=Path, help="the folder of the files the device call returned")
    ap.add_argument("--keep", type=Path, default=REPO / "reports/bench/gpu-study-call")
    ap.add_argument("--md", type=Path, default=REPO / "reports/bench/engine.md")
    ap.add_argument("--section", type=int, default=5, help="the section of --md it writes (6: a later lease's call)")
    args = ap.parse_args(argv)
    report(args.returned, args.keep, args.md, args.section)


if __name__ == "__main__":
    main()
