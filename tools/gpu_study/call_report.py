"""What a GPU study call measured, finished or cut by its budget: reports/bench/engine.md's section 5.

    python -m tools.gpu_study.call_report DIR [--keep reports/bench/gpu-study-call] [--md reports/bench/engine.md]

``DIR`` holds the files ``tools.gpu_study.device run`` returned (study.json, log.tar.gz, results.tar.gz). They are
copied to ``--keep`` (the evidence, ~0.1 MiB; the log holds no client text) and the section is written from them:
each step's seconds; the training step's pace from every run's round bar in the log (seconds per round of the set,
each run advancing one round); GPU utilisation and memory over the training from the nvidia-smi samples; and, per
arm, how far the runs were from the stop rule of ``train.stop`` when the call ended, with the round the rule would
hold if each run's curve goes on as the power law fitted to it (``pipeline.training.stopping.projected_stop``; its
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
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from benchmarks.gpu_profile import pyspy_top, read_smi, replace_section, smi_during
from tools.gpu_study.device import RESERVE_S
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


def step_windows(study: dict[str, Any], log: str, t0: float) -> dict[str, tuple[float, float]]:
    """step -> (start, end) in unix seconds: each start from its ``=== step (N s left)`` line (the budget less the
    packing reserve, less N, after ``t0``: the first nvidia-smi sample, taken as the call starts)."""
    seconds = {s["step"]: s["seconds"] for s in study["steps"] if "seconds" in s}
    windows = {}
    for m in re.finditer(r"^=== (\S+) \((\d+) s left\)$", log, re.M):
        start = t0 + study["budget_s"] - RESERVE_S - int(m.group(2))
        windows[m.group(1)] = (start, start + seconds.get(m.group(1), 0.0))
    return windows


def arm_of(experiment: str) -> str:
    return re.sub(r"-s\d+$", "", experiment)


def convergence_rows(rounds: dict[str, list[dict[str, Any]]], stop) -> list[dict[str, Any]]:
    """Per arm: rounds reached, validation loss at round 1 and at the last, the last round's relative improvement,
    runs the rule called converged, and the power law's projected stop round and holdout error (over seeds)."""
    from pipeline.training.stopping import plateaued, projected_stop, relative_improvements

    by_arm: dict[str, list[str]] = defaultdict(list)
    for exp in sorted(rounds):
        by_arm[arm_of(exp)].append(exp)
    rows = []
    for arm, exps in by_arm.items():
        series = {e: [r["val_loss_mean"] for r in rounds[e]] for e in exps}
        projections = [
            projected_stop(list(range(1, len(s) + 1)), s, stop, fit_rounds=len(s) - HOLDOUT) for s in series.values()
        ]
        rows.append(
            {
                "arm": arm,
                "runs": len(exps),
                "rounds": sorted({len(s) for s in series.values()}),
                "first": statistics.mean(s[0] for s in series.values()),
                "last": statistics.mean(s[-1] for s in series.values()),
                "last_gain": statistics.mean(relative_improvements(s)[-1] for s in series.values()),
                "converged": sum(plateaued(s, stop.min_rel_improvement, stop.patience) for s in series.values()),
                "projected": [p["stop_round"] for p in projections],
                "holdout": max(p["holdout_error"] for p in projections),
            }
        )
    return rows


def markdown(
    study: dict[str, Any], log: str, smi: list, rounds: dict[str, list], params: dict[str, Any], spy: dict | None = None
) -> str:
    from pipeline.common.config import from_dict
    from pipeline.experiments.train_config import StopConfig

    stop = from_dict(StopConfig, params["train"]["stop"], "train.stop")
    windows = step_windows(study, log, smi[0][0]) if smi else {}
    ends = round_ends(log)
    steps = "".join(f"| {s['step']} | {s['status']} | {s.get('seconds', '')} |\n" for s in study["steps"])
    durations = [b - a for e in ends.values() for n, (a, b) in enumerate(zip(e.values(), list(e.values())[1:])) if n]
    first = [e[1] for e in ends.values() if 1 in e]
    run_rounds = sum(len(r) for r in rounds.values())
    train = smi_during(smi, *windows["train"]) if "train" in windows else {}
    in_train = [u for t, u, _ in smi if "train" in windows and windows["train"][0] <= t <= windows["train"][1]]
    set_round = statistics.median(durations) if durations else float("nan")
    rows = convergence_rows(rounds, stop)
    table = "".join(
        f"| {r['arm']} | {r['runs']} | {'-'.join(map(str, r['rounds']))} | {r['first']:.3f} "
        f"| {r['last']:.3f} | {100 * r['last_gain']:.2f} | {r['converged']} of {r['runs']} | "
        f"{', '.join(str(p) if p else f'>{stop.max_rounds}' for p in r['projected'])} | {r['holdout']:.3f} |\n"
        for r in rows
    )
    before_train = windows["train"][0] - smi[0][0] if "train" in windows else float("nan")
    projected = [p or stop.max_rounds for r in rows for p in r["projected"]]
    return (
        "## 5. The GPU study's call on a lent GPU (`tools/gpu_study/device.py run`; "
        "`python -m tools.gpu_study.call_report`)\n\n"
        f"Device: {study['device'].get('gpu', 'none')}; Python {study['device']['python']}; "
        f"{datetime.fromtimestamp(smi[0][0]):%Y-%m-%d} (the first nvidia-smi sample). configs/gpu-study.yaml's "
        f"{len(rounds)} runs, the call's budget {study['budget_s']:.0f} s: it ran {study['seconds']} s and "
        f"{'completed every step' if study['complete'] else 'did not complete'}. The returned files are in "
        "reports/bench/gpu-study-call/.\n\n"
        f"| step | status | seconds |\n|---|---|---|\n{steps}\n"
        f"Training: the {len(rounds)} runs as one set (`pipeline.train` with every experiment), {run_rounds} run-rounds "
        f"(their rounds.json) before the budget cut it. The round bars of {len(ends)} runs are in the log (tqdm hides "
        f"the rest below its rows); each of those runs' first round took {min(first, default=0)}-{max(first, default=0)} s "
        f"(the prefix cache filled); after it a round of the set (every run one round) took {set_round:.1f} s "
        f"(median of {len(durations)} rounds of the runs' bars; {min(durations, default=0)}-"
        f"{max(durations, default=0)} s), **{set_round / len(rounds):.2f} s per run-round** (the runs meet "
        "at one barrier each round). GPU over the training "
        f"step: utilisation {train.get('util_mean', '-')} % on average, {_share(in_train, lambda u: u <= 5)} % of the "
        f"2-s samples at or under 5 % and {_share(in_train, lambda u: u >= 50)} % at or over 50 %; memory at most "
        f"{train.get('memory_max_mib', 0):.0f} MiB. The steps before training took {before_train:.0f} s of the call.\n\n"
        f"How far from converged at the cut (the stop rule: {stop.patience} rounds each improving the best "
        f"client-average validation loss by under {100 * stop.min_rel_improvement:g} %, at most {stop.max_rounds} "
        f"rounds; projected: the round where the rule holds on the power law fitted to each run's rounds but its "
        f"last {HOLDOUT}, whose largest error on those {HOLDOUT} is the holdout column, in nats):\n\n"
        "| arm | runs | rounds | val loss round 1 | val loss last | last round's gain % | converged | "
        "projected stop round per seed | holdout error |\n|---|---|---|---|---|---|---|---|---|\n"
        f"{table}\n"
        f"At this pace the projected stop rounds ({sum(projected)} run-rounds in all) would take "
        f"{sum(projected) * set_round / len(rounds):.0f} s of training, plus the first round's cache fill and the "
        f"{before_train:.0f} s before it, against the call's {study['budget_s']:.0f} s.\n"
    ) + (_spy_tables(spy) if spy and spy["samples"] else "")


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


def section(folder: Path) -> str:
    """Section 5 from a folder of returned files."""
    study = json.loads((folder / "study.json").read_text())
    blobs = archives(folder)
    logs, results = _members(blobs["log.tar.gz"]), _members(blobs["results.tar.gz"])
    log = logs.get("log.txt", b"").decode(errors="replace").replace("\r", "\n")
    log = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", log)  # tqdm's cursor moves between the bars of the runs
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("gpu.csv", "pyspy-train.txt"):
            (Path(tmp) / name).write_bytes(logs.get(name, b""))
        smi, spy = read_smi(Path(tmp) / "gpu.csv"), pyspy_top(Path(tmp) / "pyspy-train.txt", n=40)
    rounds = {
        name.split("/")[-2]: json.loads(blob)
        for name, blob in results.items()
        if re.fullmatch(r"reports/train/[^/]+/rounds\.json", name)
    }
    return markdown(study, log, smi, rounds, yaml.safe_load(results["params.yaml"]), spy)


def report(returned: Path, keep: Path, md: Path) -> None:
    """Copy the returned files to ``keep`` and rewrite ``md``'s section 5 from them."""
    if returned.resolve() != keep.resolve():
        keep.mkdir(parents=True, exist_ok=True)
        for f in returned.iterdir():
            if f.is_file():
                shutil.copy(f, keep / f.name)
    replace_section(md, 5, section(keep), "The set engine (issue 53)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("returned", type=Path, help="the folder of the files the device call returned")
    ap.add_argument("--keep", type=Path, default=REPO / "reports/bench/gpu-study-call")
    ap.add_argument("--md", type=Path, default=REPO / "reports/bench/engine.md")
    args = ap.parse_args(argv)
    report(args.returned, args.keep, args.md)


if __name__ == "__main__":
    main()
