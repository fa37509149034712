"""The set engine on a lent GPU (issues 53 and 54): the GPU study's 30 runs trained together, a few rounds, against
the same runs one at a time, on the study's data and backbone: the seconds per run-round the study will pay.

On the lent machine, after the staging call of docs/gpu-lease.md (the same carry as the study's):

    python3 -m benchmarks.gpu_engine device --carry .gpu-study/carry --out "$OUT"

runs ``measure`` under ``benchmarks/gpu_profile.py``'s wrapper (wheels, MiniLM weights, ``nvidia-smi`` every
0.25 s): the workspace of ``benchmarks/engine.py`` with configs/gpu-study.yaml merged into params.yaml (the three
full QMSum domain clients, the real MiniLM-L6 BERT2BERT with random cross-attention: a speed measurement), the
study's experiments planned as the plan stage plans them but for ``--rounds`` fixed rounds (no stop rule), then

1. a one-round warm-up run that fills the prefix cache;
2. ``together``: every run of the study as one set (``run_set``);
3. ``alone``: the six seed-0 runs (one per arm), each as a set of one;
4. the largest adapter difference between a seed-0 run trained alone and in the set, and whether their best and
   stop rounds agree; the FLOPs of every run's rounds (``benchmarks/flops.py``) against the device's measured
   ``torch.mm`` rates.

``engine.json`` (written after each step) and ``smi.csv`` go to ``--out``; here ``python -m benchmarks.gpu_engine
report [DIR]`` rewrites reports/bench/engine.md's section 4 from them (the lease's files: reports/bench/gpu-engine/).
``measure --tiny`` runs the same code on this CPU with the tests' tiny BART and the six seed-0 runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_profile import REPO, Record, cuda_sync, mm_rates, read_smi, replace_section, smi_during

SEED0_ARMS = 6  # the study's arms: one run each at seed 0


def _study_plans(work: Path, params: dict[str, Any], rounds: int, tiny: bool) -> list[Path]:
    """The study's experiments planned with ``rounds`` fixed rounds (stop rule off); tiny: the seed-0 runs."""
    from pipeline.planning import declared, resolve_plan

    run_params = params | {"train": params["train"] | {"rounds": rounds, "stop": {"enabled": False}}}
    entries = [e for e in declared(run_params) if not tiny or e.seed == 0]
    paths = []
    for entry in entries:
        path = work / "models" / "plans" / f"{entry.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(resolve_plan(entry, run_params), indent=2, sort_keys=True))
        paths.append(path)
    return paths


def measure(qmsum: Path, out: Path, work: Path, tiny: bool = False, rounds: int = 2) -> dict[str, Any]:
    import torch
    import yaml

    from benchmarks import engine
    from benchmarks.common import default_shape
    from pipeline.experiments.plans import read_plan
    from pipeline.train import run_set
    from pipeline.training import local_batch
    from tools.gpu_study.device import PROFILE, merge_profile

    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rec = Record(out / "engine.json")
    gpu = torch.cuda.is_available()
    rec.data |= {"device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__}
    params = merge_profile(yaml.safe_load((REPO / "params.yaml").read_text()), yaml.safe_load(PROFILE.read_text()))
    if tiny:
        params["train"] |= {"max_train_examples_per_client": 4, "max_valid_examples_per_client": 2}
    params_path = work / "engine-params.yaml"
    params_path.write_text(yaml.safe_dump(params))
    t = time.time()
    params = engine.build_workspace(work, str(params_path), tiny=tiny, qmsum=qmsum)
    os.chdir(work)
    os.environ["FEDMEET_ROOT"] = str(work)
    plans = _study_plans(work, params, rounds, tiny)
    alone = [p for p in plans if read_plan(p).seed == 0][:SEED0_ARMS]
    rec.data |= {"runs": len(plans), "rounds_per_run": rounds, "alone_runs": [p.stem for p in alone]}
    rec.data["mm_tflops"] = mm_rates() if gpu else {}
    rec.step("workspace", t)

    t = time.time()
    run_set(engine.write_plans(work, params, ("fedavg",), rounds=1, prefix="warmup"), track=False)
    rec.step("warmup_fill_cache", t)

    outcome = {}
    for mode, sets in (("together", [plans]), ("alone", [[p] for p in alone])):
        t, before = time.time(), dict(local_batch.STATS)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        for group in sets:
            run_set(group, track=False)
        cuda_sync()
        stacked = {k: local_batch.STATS[k] - before[k] for k in ("groups", "runs_stacked")}
        outcome[mode] = engine._published([p.stem for p in alone])  # reads and clears the seed-0 runs' outputs
        rec.step(
            mode,
            t,
            run_rounds=sum(len(s) for s in sets) * rounds,
            client_rounds_per_group=round(stacked["runs_stacked"] / max(stacked["groups"], 1), 2),
            peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None,
        )
    names = [p.stem for p in alone]
    rec.data["max_abs_adapter_diff"] = max(
        float((outcome["alone"][n]["adapters"][k] - outcome["together"][n]["adapters"][k]).abs().max())
        for n in names
        for k in outcome["alone"][n]["adapters"]
    )
    rec.data["same_rounds"] = all(outcome["alone"][n]["rounds"] == outcome["together"][n]["rounds"] for n in names)
    shape = default_shape(read_plan(plans[0]).model_config, 1)
    rec.data["tflop_together"] = round(sum(engine.round_flops(p, shape) for p in plans) * rounds / 1e12, 3)
    rec.data["tflop_alone"] = round(sum(engine.round_flops(p, shape) for p in alone) * rounds / 1e12, 3)
    rec.save()
    return rec.data


def finished_runs(log: str) -> dict[str, tuple[int, int]]:
    """(rounds, elapsed seconds) of each run whose round bar reached 100 % in a measure log (tqdm's last line)."""
    done = {}
    for m in re.finditer(r"([\w.-]+) rounds: 100%\|[^|]*\| (\d+)/\d+ \[(?:(\d+):)?(\d+):(\d+)<", log):
        hours = int(m.group(3) or 0)
        done[m.group(1)] = (int(m.group(2)), 3600 * hours + 60 * int(m.group(4)) + int(m.group(5)))
    return done


def markdown(data: dict[str, Any], smi: list[tuple[float, float, float]], log: str = "") -> str:
    steps, rates = data["steps"], data.get("mm_tflops") or {}
    lines = [
        "## 4. The GPU study's set on a lent GPU (`python -m benchmarks.gpu_engine`)",
        "",
        f"Device: {data['device']} (torch {data['torch']}). The {data['runs']} runs of configs/gpu-study.yaml "
        f"(6 arms x 5 seeds, the three full QMSum domain clients, the real MiniLM-L6 BERT2BERT with random "
        f"cross-attention), {data['rounds_per_run']} fixed rounds each; alone: the seed-0 run of each arm, each as a "
        "set of one. The prefix cache was filled by a warm-up run first.",
    ]
    table = [
        "",
        "| | runs | run-rounds | wall s | s per run-round | client rounds per stacked group | GPU util mean % "
        "| peak GiB | x floor fp32 | x floor bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, tflop, runs in (
        ("together", data.get("tflop_together"), data["runs"]),
        ("alone", data.get("tflop_alone"), len(data["alone_runs"])),
    ):
        s = steps.get(mode)
        if not s:
            continue
        u = smi_during(smi, s["start"], s["end"])
        floors = [
            f"{s['seconds'] / (tflop / rates[p]):.0f}" if tflop and rates else "-" for p in ("float32", "bfloat16")
        ]
        table.append(
            f"| {mode} | {runs} | {s['run_rounds']} | {s['seconds']:.1f} | {s['seconds'] / s['run_rounds']:.3f} | "
            f"{s['client_rounds_per_group']} | {u.get('util_mean', '-')} | {s['peak_memory_gib']} | "
            f"{floors[0]} | {floors[1]} |"
        )
    lines += table if len(table) > 3 else []
    if "together" not in steps:
        done = {n: v for n, v in finished_runs(log).items() if not n.startswith("warmup")}
        serverless = [n for n in done if n.startswith(("single", "centralized"))]
        cut = max(s["end"] for s in steps.values())
        ended = re.search(r"measure: (\S+); ([\d.]+) s in all", log)
        lines += [
            "",
            f"**The set did not finish within the command's budget** (the measurement's end: "
            f"{ended.group(1) if ended else '?'} after {ended.group(2) if ended else '?'} s in all): the steps "
            f"recorded are {', '.join(steps)}; after them "
            f"{len(done)} of the set's {data['runs']} runs finished their {data['rounds_per_run']} rounds, one after "
            f"the other, all of them without a server ({', '.join(serverless)}), each "
            f"{min(t for _, t in done.values()) if done else '-'}-{max(t for _, t in done.values()) if done else '-'} "
            "s (the bars of the log); the federated runs had started their first round. GPU utilisation after the "
            f"warm-up: {smi_during(smi, cut, float('inf')).get('util_mean', '-')} % on average.",
        ]
    if "together" in steps and "alone" in steps:
        per = {m: steps[m]["seconds"] / steps[m]["run_rounds"] for m in ("together", "alone")}
        lines += [
            "",
            f"Together, a run-round took {per['alone'] / per['together']:.1f}x less time than alone. The seed-0 runs "
            f"trained in the set and alone: largest adapter difference {data['max_abs_adapter_diff']:.1e}, best and "
            f"stop rounds {'identical' if data['same_rounds'] else 'DIFFERENT'}. The floor: benchmarks/flops.py's "
            f"matmul FLOPs of the rounds ({data['tflop_together']} TFLOP together, {data['tflop_alone']} alone) at "
            f"the device's measured `torch.mm` rates ({rates.get('float32')} TFLOP/s float32, "
            f"{rates.get('bfloat16')} bfloat16).",
        ]
    return "\n".join(lines) + "\n"


def report(src: Path, md: Path) -> None:
    """Rewrite ``md``'s section 4 from a returned folder (engine.json, smi.csv); the other sections stay."""
    data = json.loads((src / "engine.json").read_text())
    log = (src / "log.txt").read_text(errors="replace").replace("\r", "\n") if (src / "log.txt").is_file() else ""
    replace_section(md, 4, markdown(data, read_smi(src / "smi.csv"), log), "The set engine (issue 53)")


def main(argv: list[str] | None = None) -> int:
    from benchmarks import gpu_profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    _, me = gpu_profile.device_and_measure_parsers(sub, Path("/tmp/gpu-engine"), 240)
    me.add_argument("--rounds", type=int, default=2)
    rep = sub.add_parser("report", help="reports/bench/engine.md section 4 from a returned folder")
    rep.add_argument("src", type=Path, nargs="?", default=REPO / "reports" / "bench" / "gpu-engine")
    rep.add_argument("--md", type=Path, default=REPO / "reports" / "bench" / "engine.md")
    args = ap.parse_args(argv)
    if args.command == "device":
        carry, out = args.carry.resolve(), args.out.resolve()
        return gpu_profile.device(carry, out, args.work, args.budget, module="benchmarks.gpu_engine")
    if args.command == "report":
        report(args.src, args.md)
        return 0
    work = (args.work or Path(tempfile.mkdtemp(prefix="gpu-engine-"))).resolve()
    print(json.dumps(measure(args.qmsum, args.out.resolve(), work, args.tiny, args.rounds), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
