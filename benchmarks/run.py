"""Run every benchmark in one process and write ``reports/bench/`` (``make bench``).

    python -m benchmarks.run            # full profile (~10-14 min on a quiet 2-core machine, scale ~3.5 of them)
    python -m benchmarks.run --quick    # 2-3 minute smoke run with reduced shapes (scale: 3 and 10 clients) ->
    reports/bench/quick/

Outputs: train_step.json, generation.json, communication.json, memory.json, scale.json + scale.png (federated
engines at 3..100 clients, benchmarks/scale.py) and README.md (tables, targets).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks import readme  # noqa: E402
from benchmarks.common import bart_base_shape, default_shape, load_model_config, matmul_peak, write_json  # noqa: E402


@dataclass
class Profile:
    name: str
    matmul_sizes: tuple[int, ...]
    matmul_repeats: int
    train_repeats: int
    bart_batch: int
    bart_source: int
    bart_target: int
    default_batch: int | None  # None = params.yaml train.batch_size
    default_source: int | None  # None = params.yaml model.max_source_length
    default_target: int | None
    gen_examples_default: int
    gen_examples_bart: int
    gen_tokens: int | None  # None = the shape's target length
    gen_repeats: int


FULL = Profile(
    "full",
    (2048, 3072, 4096),
    5,
    5,
    bart_batch=4,
    bart_source=1024,
    bart_target=100,
    default_batch=None,
    default_source=None,
    default_target=None,
    gen_examples_default=4,
    gen_examples_bart=2,
    gen_tokens=None,
    gen_repeats=3,
)
QUICK = Profile(
    "quick",
    (512, 1024),
    3,
    2,
    bart_batch=1,
    bart_source=256,
    bart_target=32,
    default_batch=2,
    default_source=128,
    default_target=32,
    gen_examples_default=1,
    gen_examples_bart=1,
    gen_tokens=8,
    gen_repeats=1,
)


def study_uses(params_path: str) -> dict[str, int]:
    """How often one prefix is reused: every local epoch of every round of every experiment trains on it."""
    from pipeline.common.cli import read_params
    from pipeline.experiments.train_config import TrainConfig

    params, train = read_params(params_path, train=TrainConfig)
    per_experiment = train.rounds * train.local_epochs
    uses = {"first use": 1, "one experiment (rounds x local epochs)": per_experiment}
    n_exp = len(params.get("experiments") or {})
    if n_exp > 1:
        uses[f"all {n_exp} experiments of params.yaml"] = per_experiment * n_exp
    return uses


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke profile (reduced shapes, 2-3 minutes)")
    ap.add_argument(
        "--out", type=Path, default=None, help="output dir (default reports/bench, quick: reports/bench/quick)"
    )
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads (2 = the reference machine; 1 gives saner numbers on an oversubscribed one)",
    )
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite README.md from the JSON files already in the output dir (no measuring)",
    )
    args = ap.parse_args(argv)
    profile = QUICK if args.quick else FULL
    out = args.out or (Path("reports/bench/quick") if args.quick else Path("reports/bench"))
    if args.render_only:
        readme.write(load_results(out), out / "README.md")
        print(f"{out}/README.md rewritten")
        return
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    from benchmarks.communication import bench_communication
    from benchmarks.generation import bench_generation
    from benchmarks.memory import collect

    shapes = _shapes(args.params, profile)

    steps = [
        "matmul peak",
        "train bart_base",
        "train default",
        "matmul peak (again)",
        "generation default",
        "generation bart_base",
        "communication default",
        "communication bart_base",
        "memory",
        "scale",
    ]
    bar = tqdm(total=len(steps), desc=f"bench ({profile.name})", unit="part")

    def advance(label: str) -> None:
        bar.set_postfix_str(label)
        bar.update(1)

    peak, train = _train_steps(profile, shapes, study_uses(args.params), advance)

    generation = {}
    for key, n in (("default", profile.gen_examples_default), ("bart_base", profile.gen_examples_bart)):
        shape = shapes[key]
        generation[key] = bench_generation(shape, n, profile.gen_tokens or shape.target_length, profile.gen_repeats)
        advance(f"generation {key}")
    communication = {}
    for key in ("default", "bart_base"):
        communication[key] = bench_communication(shapes[key])
        advance(f"communication {key}")
    memory = collect()
    advance("memory")
    from benchmarks.scale import QUICK_SIZES, ScaleConfig, bench_scale
    from benchmarks.scale import plot as plot_scale

    scale = bench_scale(
        ScaleConfig(threads=args.threads)
        if profile.name == "full"
        else ScaleConfig(sizes=QUICK_SIZES, threads=args.threads)
    )
    advance("scale")
    bar.close()

    meta = {
        "profile": profile.name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    write_json(out / "train_step.json", {"meta": meta, "machine": peak, "shapes": train})
    write_json(out / "generation.json", {"meta": meta, "shapes": generation})
    write_json(out / "communication.json", {"meta": meta, "shapes": communication})
    write_json(out / "memory.json", {"meta": meta, **memory})
    write_json(out / "scale.json", {"meta": meta, **scale})
    plot_scale(scale, out / "scale.png")
    results = {
        "meta": meta,
        "machine": peak,
        "train_step": _plain(train),
        "generation": _plain(generation),
        "communication": _plain(communication),
        "memory": memory,
        "scale": scale,
    }
    readme.write(results, out / "README.md")
    print(f"benchmarks written to {out}/ in {meta['seconds']:.0f} s")


def _shapes(params_path: str, profile: Profile) -> dict:
    """The two measured shapes: BART-base's and the study's default (params.yaml, reduced by the quick profile)."""
    from pipeline.common.cli import read_params
    from pipeline.experiments.train_config import TrainConfig

    model_cfg = load_model_config(params_path)
    train_cfg = read_params(params_path, train=TrainConfig)[1]
    default = default_shape(model_cfg, profile.default_batch or train_cfg.batch_size)
    default = replace(
        default,
        source_length=profile.default_source or default.source_length,
        target_length=profile.default_target or default.target_length,
    )
    bart = bart_base_shape(profile.bart_batch, profile.bart_source, profile.bart_target)
    return {"bart_base": bart, "default": default}


def _train_steps(profile: Profile, shapes: dict, uses: dict[str, int], advance) -> tuple[dict, dict]:
    """The machine's matmul peak before and after the train steps, and each shape's train step against its FLOP
    bound (at the best peak seen in this run)."""
    from benchmarks.train_step import bench_shape

    before = matmul_peak(profile.matmul_sizes, profile.matmul_repeats)
    advance("matmul peak")
    train = {}
    for key, shape in shapes.items():
        train[key] = bench_shape(shape, profile.train_repeats, before["peak_gflops"], uses)
        advance(f"train {key}")
    after = matmul_peak(profile.matmul_sizes, profile.matmul_repeats)
    advance("matmul peak (again)")
    peak = dict(before)
    peak.update(before=before["peak_gflops"], after=after["peak_gflops"], sizes_after=after["sizes"])
    peak["peak_gflops"] = max(before["peak_gflops"], after["peak_gflops"])
    if peak["peak_gflops"] != before["peak_gflops"]:  # bounds use the best peak seen in this run
        for tr in train.values():
            for v in tr["variants"].values():
                scale = before["peak_gflops"] / peak["peak_gflops"]
                v["flop_bound_seconds_per_example"] = round(v["flop_bound_seconds_per_example"] * scale, 5)
                v["measured_over_bound"] = round(v["seconds_per_example"] / v["flop_bound_seconds_per_example"], 3)
    return peak, train


def load_results(out: Path) -> dict:
    """The results dict ``readme.render`` takes, read back from the JSON files of a finished run."""
    import json

    def read(name: str) -> dict:
        path = out / name
        if not path.exists():
            raise FileNotFoundError(f"{path}: missing; run `python -m benchmarks.run` first")
        return json.loads(path.read_text())

    train, gen, comm, mem = (read(f"{n}.json") for n in ("train_step", "generation", "communication", "memory"))
    mem.pop("meta", None)
    results = {
        "meta": train["meta"],
        "machine": train["machine"],
        "train_step": train["shapes"],
        "generation": gen["shapes"],
        "communication": comm["shapes"],
        "memory": mem,
    }
    if (out / "scale.json").exists():  # written by benchmarks.scale on its own as well
        results["scale"] = read("scale.json")
    return results


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _plain(obj):
    """Dataclasses -> dicts (the README renderer reads plain JSON-like data)."""
    import json

    from benchmarks.common import _jsonable

    return json.loads(json.dumps(obj, default=_jsonable))


if __name__ == "__main__":
    main()
