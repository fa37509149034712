"""The study call's expected GPU time: an estimate, from the cpu-study's measured H100 timings and the FLOP floor.

    python -m tools.gpu_study.estimate [--rounds 12 40]      # the table docs/gpu-lease.md shows

Measured (reports/cpu-study/timing/device-study.json, one H100, 7-8 runs sharing it, today's path: a process per run,
8 rounds each): the backbone's warm-up with scoring, each run's training and its evaluation (beam 4, all 244 test
examples, decoding batch 8). The estimate takes the study's runs as trained one after another (the sum over runs, at
the per-round rate each arm was measured at): an upper bound, since pipeline.train.run_set now trains the rounds of
runs that share micro-batches together, stacked (pipeline.training.local_batch), and that rate is an upper bound
alone on the GPU (issue 53: halving the sharing saved only 20 %, a round being serial host work).
The floor: benchmarks/flops.py's matmul FLOPs of a round (the prefix-cached path, forward and backward, on every
training example; forward on every validation example) at the study's maximum lengths (an upper bound of the real
token counts), divided by the H100's dense peak (vendor figures below): the time no engine can beat.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from tools.gpu_study.device import PROFILE, REPO, merged_params

TIMINGS = REPO / "reports/cpu-study/timing/device-study.json"
CPU_STUDY_ROUNDS = 8  # configs/cpu-study.yaml train.rounds
H100_PEAK = {"fp32": 67e12, "bf16": 989e12}  # NVIDIA H100 SXM datasheet, dense FLOP/s (no sparsity); H200 SXM's too


def measured(timings: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per arm (method, plus the quantile gate): seconds per training round and per evaluation, means over seeds."""
    arms: dict[str, dict[str, list[float]]] = {}
    for key, seconds in timings.items():
        stage, _, name = key.partition("-")
        if stage in ("train", "evaluate"):
            arm = name.rsplit("-s", 1)[0]
            per = seconds / CPU_STUDY_ROUNDS if stage == "train" else seconds
            arms.setdefault(arm, {}).setdefault(stage, []).append(per)
    return {arm: {k: sum(v) / len(v) for k, v in d.items()} for arm, d in arms.items()}


def floor_flops_per_round(n_train: int, n_valid: int, two_paths: bool, params: dict | None = None) -> float:
    """One run's round at the study's shapes (``params``' model; default the profile merged): every training example
    forward + backward, every validation example forward, on the prefix-cached path (a KD arm runs the teacher's top
    path forward as well)."""

    from benchmarks.common import default_shape
    from benchmarks.flops import step_flops, top_path
    from pipeline.common.config import from_dict
    from pipeline.experiments.model import ModelConfig

    params = params or merged_params(REPO, PROFILE)
    shape_keys = {f.name for f in dataclasses.fields(ModelConfig)}  # the model's shape, not the cache settings
    model = {k: v for k, v in params["model"].items() if k in shape_keys}
    shape = default_shape(from_dict(ModelConfig, model, "model"), batch_size=1)
    step = step_flops(shape)["prefix_cached"]
    teacher = 2 * top_path(shape) if two_paths else 0.0  # the frozen teacher's path, forward only
    return n_train * (step["total"] + teacher) + n_valid * step["forward"] / 2


def study_arms() -> dict[str, int]:
    """Arm -> runs in the profile (the seeds), arm named as the timing keys name it."""
    import yaml

    arms: dict[str, int] = {}
    for name in yaml.safe_load(PROFILE.read_text())["experiments"]:
        arm = name.rsplit("-s", 1)[0]
        arms[arm] = arms.get(arm, 0) + 1
    return arms


def client_counts(report: dict[str, Any]) -> tuple[int, int]:
    """Training and validation examples over all clients, from a partition stage report (its parsed JSON)."""
    sizes = [c["sizes"] for c in report["clients"].values()]
    return sum(s["train"] for s in sizes), sum(s["valid"] for s in sizes)


def estimate(rounds: list[int], partition: Path) -> str:
    per_arm = measured(json.loads(TIMINGS.read_text()))
    arms = study_arms()
    backbone = max(v for k, v in json.loads(TIMINGS.read_text()).items() if k.startswith("backbone-"))
    n_train, n_valid = client_counts(json.loads(partition.read_text()))
    evaluate = sum(per_arm[a]["evaluate"] * n for a, n in arms.items())
    lines = [
        f"study: {sum(arms.values())} runs ({', '.join(f'{a} x{n}' for a, n in arms.items())}); "
        f"{n_train} training and {n_valid} validation examples a round ({partition.name})",
        f"backbone warm-up + scoring, measured: {backbone:.0f} s (4 recipes sharing the H100: an upper bound)",
        f"evaluation, today's path (measured per run, batch 8) summed: {evaluate:.0f} s",
        "| rounds a run | training today (s) | floor fp32 (s) | floor bf16 (s) |",
        "|---|---|---|---|",
    ]
    for r in rounds:
        today = sum(per_arm[a]["train"] * n * r for a, n in arms.items())
        flops = sum(floor_flops_per_round(n_train, n_valid, "kd" in a) * n * r for a, n in arms.items())
        lines.append(f"| {r} | {today:.0f} | {flops / H100_PEAK['fp32']:.1f} | {flops / H100_PEAK['bf16']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, nargs="+", default=[12, 40])
    ap.add_argument("--partition", type=Path, default=REPO / "reports/partitions/domain-seed0.json")
    args = ap.parse_args(argv)
    print(estimate(args.rounds, args.partition))


if __name__ == "__main__":
    main()
