"""Today's training and evaluation path, profiled on a lent GPU (issue 54, item 1): where a round's time goes.

On the lent machine, from the repo root, after the staging call of docs/gpu-lease.md (the same carry as the study's):

    python3 -m benchmarks.gpu_profile device --carry .gpu-study/carry --out "$OUT"

installs the carried wheels, puts the MiniLM weights back together, samples ``nvidia-smi`` every 0.25 s and runs
``measure`` in a child process: the workspace of ``benchmarks/engine.py`` with the GPU study's parameters
(configs/gpu-study.yaml merged into params.yaml: the full QMSum domain clients, batch 8 x 2, top 2 layers adapted,
the real MiniLM-L6 BERT2BERT with random cross-attention: a speed measurement), then

1. one round of the two-path arm (fedselectkd) that fills the prefix cache (``run_set``, as the train stage runs it);
2. the same round again, timed (the cache read from disk, as every later round reads it);
3. the same round under ``torch.profiler`` (CPU and CUDA activities): the top operations by device and by host time,
   the device's busy time against the wall time;
4. the same round under ``cProfile``: the Python functions the host time goes to;
5. one client's evaluation (Academic's test examples, beam 4) with the stage's ``generate_per_run`` at the old
   decoding batch (8, under ``torch.profiler``) and at the study's (64);
6. ``torch.mm`` rates of the device in float32 and bfloat16, and ``benchmarks/flops.py``'s FLOPs of the round: the
   floor the round is compared with.

Everything goes to ``profile.json`` (written after each step, so a cut run keeps what it measured), ``smi.csv`` and
``log.txt`` under ``--out``; the lease's are kept in reports/bench/gpu-profile/. Here, ``python -m
benchmarks.gpu_profile report [DIR]`` rewrites reports/bench/gpu.md's first section from such a folder. ``measure
--tiny`` runs the same code on this CPU with the tests' tiny BART (tests/test_gpu_profile.py).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SMI_QUERY = "timestamp,utilization.gpu,memory.used"
TOP = 15
PROFILED = (48, 16)  # train and valid examples a client in the profiled rounds


# --------------------------------------------------------------------------------------------- on the lent machine
def device(
    carry: Path,
    out: Path,
    work: Path,
    budget_s: float,
    tiny: bool = False,
    module: str = "benchmarks.gpu_profile",
    extra: tuple[str, ...] = (),
) -> int:
    """Install, assemble, sample ``nvidia-smi`` and run ``module``'s ``measure`` in a child (stdlib only in this
    process)."""
    from tools.gpu_study.device import STAGE_DIR, assemble_minilm, child_env, device_info, install_wheels

    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = (out / "log.txt").open("w")
    rc = install_wheels(carry / "wheels", work / "site", log)
    minilm = assemble_minilm(carry, STAGE_DIR, work / "minilm")
    with tarfile.open(carry / "raw.tar.gz") as tar:
        tar.extractall(work / "raw", members=[m for m in tar if m.name.startswith("qmsum")], filter="data")
    print(f"install rc {rc}, weights and data ready in {time.monotonic() - t0:.1f} s", file=log, flush=True)
    smi = None
    if shutil.which("nvidia-smi"):
        smi = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits", "-lms", "250"],
            stdout=(out / "smi.csv").open("w"),
            stderr=subprocess.DEVNULL,
        )
    env = child_env(REPO, work / "site", minilm)
    env.pop("FEDMEET_ROOT")  # measure makes its own workspace
    argv = [sys.executable, "-m", module, "measure", "--qmsum", str(work / "raw" / "qmsum")]
    argv += ["--out", str(out), "--work", str(work / "repo"), *extra] + (["--tiny"] if tiny else [])
    if (carry / "py-spy").is_file():  # a carried py-spy samples the measured round's threads
        shutil.copy(carry / "py-spy", work / "py-spy")
        (work / "py-spy").chmod(0o755)
        env["FEDMEET_PYSPY"] = str(work / "py-spy")
    try:
        rc = subprocess.run(
            argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=budget_s - (time.monotonic() - t0)
        ).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if smi is not None:
        smi.terminate()
        smi.wait()
    print(f"measure: {rc}; {time.monotonic() - t0:.1f} s in all; device {device_info()}", file=log, flush=True)
    log.close()
    return 0 if rc == 0 else 1


# ------------------------------------------------------------------------------------------------- the measurement
class Record:
    """A measurement's JSON file, rewritten after each step; each step's wall-clock start and end for the smi
    samples."""

    def __init__(self, path: Path):
        self.path, self.data = path, {"steps": {}}

    def step(self, name: str, t_start: float, **values: Any) -> None:
        self.data["steps"][name] = {"start": t_start, "end": time.time(), "seconds": time.time() - t_start, **values}
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")


def cuda_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _top_ops(prof, key: str, n: int = TOP) -> list[dict[str, Any]]:
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:n]
    return [
        {
            "op": e.key,
            "calls": e.count,
            "self_device_ms": round(e.self_device_time_total / 1e3, 2),
            "self_host_ms": round(e.self_cpu_time_total / 1e3, 2),
        }
        for e in rows
    ]


def device_busy_seconds(events) -> float:
    """Kernels' summed time: an operator's row repeats its kernels' time and user annotations span them (as in
    torch's own table total, ``profiler_util._build_table``), so only device rows that are not annotations count."""
    return (
        sum(e.self_device_time_total for e in events if e.device_type.name != "CPU" and not e.is_user_annotation) / 1e6
    )


def _torch_profiled(fn, device_ok: bool) -> dict[str, Any]:
    """Wall seconds of ``fn()`` under torch.profiler; its top operations and the device's busy time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_ok else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        fn()
        cuda_sync()
        wall = time.perf_counter() - t
    events = prof.key_averages()
    busy = device_busy_seconds(events)
    return {
        "wall_s": round(wall, 3),
        "device_busy_s": round(busy, 3),
        "device_busy_share": round(busy / wall, 4),
        "top_by_device": _top_ops(prof, "self_device_time_total"),
        "top_by_host": _top_ops(prof, "self_cpu_time_total"),
    }


def _cprofiled(fn) -> dict[str, Any]:
    profiler = cProfile.Profile()
    t = time.perf_counter()
    profiler.runcall(fn)
    cuda_sync()
    wall = time.perf_counter() - t
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:TOP]  # (cc, nc, tottime, cumtime, _)
    return {
        "wall_s": round(wall, 3),
        "top_by_self": [
            {"function": f"{Path(f).name}:{line}({name})", "calls": nc, "self_s": round(tt, 3), "cum_s": round(ct, 3)}
            for (f, line, name), (_, nc, tt, ct, _) in rows
        ],
    }


def mm_rates(n: int = 8192, repeats: int = 10) -> dict[str, float]:
    """TFLOP/s of an n x n x n ``torch.mm`` on the device, float32 (no TF32) and bfloat16."""
    import torch

    if not torch.cuda.is_available():
        return {}
    rates = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
        torch.mm(a, b)
        cuda_sync()
        t = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        cuda_sync()
        rates[name] = round(2 * n**3 * repeats / (time.perf_counter() - t) / 1e12, 1)
    return rates


def _evaluator(work: Path, plan, mcfg):
    """``evaluate(batch, n)``: Academic's first ``n`` test examples (None: all) summarised at decoding batch
    ``batch``, beam 4, by the run's best adapter; returns how many."""
    import pandas as pd

    from pipeline.modeling.adapters import adapter_file, load_adapter
    from pipeline.modeling.model import AdapterSummarizer, adapter_config
    from pipeline.results.evaluation import EvaluateConfig, generate_per_run

    model = AdapterSummarizer.from_pretrained(str(work / "models" / "backbone"), adapter_config(mcfg))
    adapter = load_adapter(adapter_file(work / "models" / plan.experiment / "clients" / "Academic", "best"))
    test = json.loads((work / "data" / "partitions" / "domain" / "seed0.json").read_text())["clients"]["Academic"]
    frame = pd.read_parquet(work / "data" / "processed" / "examples.parquet").set_index("example_id")
    sources = frame.loc[test["test"], "source"].tolist()

    def evaluate(batch: int, n: int | None) -> int:
        chosen = sources[:n]
        cfg = EvaluateConfig(num_beams=4, batch_size=batch)
        generate_per_run(model, [adapter], [chosen], cfg, mcfg.max_source_length, f"eval batch {batch}")
        return len(chosen)

    return evaluate


@contextlib.contextmanager
def _pyspy(path: Path):
    """py-spy sampling every thread of this process while the block runs (its raw stacks to ``path``), when a py-spy
    executable is at $FEDMEET_PYSPY or on PATH; else nothing."""
    exe = os.environ.get("FEDMEET_PYSPY") or shutil.which("py-spy")
    if not exe:
        yield
        return
    cmd = [exe, "record", "--pid", str(os.getpid()), "--nonblocking", "-r", "100", "-f", "raw", "-o", str(path)]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy.wait(timeout=60)


def pyspy_top(path: Path, n: int = TOP) -> dict[str, list[tuple[str, int]]]:
    """The functions of a py-spy raw file by samples: on top of a stack (own) and anywhere in it (within)."""
    own, within, total = Counter(), Counter(), 0
    for line in path.read_text().splitlines() if path.is_file() else []:
        stack, _, count = line.rpartition(" ")
        frames = [f for f in stack.split(";") if f]
        if not frames or not count.isdigit():
            continue
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in dict.fromkeys(frames):  # each frame once, in stack order: ties rank alike in every process
            within[frame] += int(count)
    return {"samples": total, "own": own.most_common(n), "within": within.most_common(4 * n)}


def measure(
    qmsum: Path,
    out: Path,
    work: Path,
    tiny: bool = False,
    eval_batches: tuple[int, ...] = (8, 64),
    train_only: bool = False,
) -> dict:
    import torch
    import yaml

    from benchmarks import engine
    from benchmarks.common import default_shape
    from pipeline.experiments.plans import read_plan
    from pipeline.train import run_set
    from tools.gpu_study.device import PROFILE, merge_profile

    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rec = Record(out / "profile.json")
    gpu = torch.cuda.is_available()
    rec.data["device"] = torch.cuda.get_device_name() if gpu else "cpu"
    rec.data["torch"] = torch.__version__
    params = merge_profile(yaml.safe_load((REPO / "params.yaml").read_text()), yaml.safe_load(PROFILE.read_text()))
    if tiny:  # this CPU: a few examples a client
        params["train"] |= {"max_train_examples_per_client": 4, "max_valid_examples_per_client": 2}
    params_path = work / "profile-params.yaml"
    params_path.write_text(yaml.safe_dump(params))
    t = time.time()
    params = engine.build_workspace(work, str(params_path), tiny=tiny, qmsum=qmsum, n_test=None if not tiny else 3)
    os.chdir(work)
    os.environ["FEDMEET_ROOT"] = str(work)
    (plan,) = engine.write_plans(work, params, ("fedselectkd",), rounds=1)
    rec.step("workspace", t)
    the_plan = read_plan(plan)
    mcfg = the_plan.model_config
    flop = engine.round_flops(plan, default_shape(mcfg, 1))
    rec.data |= {"round_tflop": round(flop / 1e12, 3), "mm_tflops": mm_rates() if gpu else {}}
    rec.save()

    # the most telling steps first: a run cut by its budget keeps them
    for name in ("round_fill_cache", "round"):
        if gpu:  # each round's own peak: max_memory_allocated is the process's since the last reset
            torch.cuda.reset_peak_memory_stats()
        t = time.time()
        with _pyspy(out / "pyspy-round.txt") if name == "round" else contextlib.nullcontext():
            run_set([plan], track=False)
            cuda_sync()
        rec.step(name, t, peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if gpu else None)
    if train_only:
        return rec.data

    evaluate = _evaluator(work, the_plan, mcfg)
    for batch in eval_batches:
        t = time.time()
        n = evaluate(batch, None)
        cuda_sync()
        rec.step(f"evaluate_batch{batch}", t, examples=n, beams=4)
    # the profilers' own cost grows with the events they record: they see a round of the first examples only
    caps = {"max_train_examples_per_client": PROFILED[0], "max_valid_examples_per_client": PROFILED[1]}
    (small,) = engine.write_plans(work, params | {"train": params["train"] | caps}, ("fedselectkd",), 1, "profiled")
    t = time.time()
    run_set([small], track=False)  # the prefix cache already has these examples
    cuda_sync()
    rec.step("round_subset", t, train_valid_examples_a_client=PROFILED)
    t = time.time()
    rec.step("round_torch_profiler", t, **_torch_profiled(lambda: run_set([small], track=False), gpu))
    t = time.time()
    rec.step("round_cprofile", t, **_cprofiled(lambda: run_set([small], track=False)))
    t = time.time()
    n, batch = [], eval_batches[0]
    prof = _torch_profiled(lambda: n.append(evaluate(batch, batch)), gpu)
    rec.step("evaluate_torch_profiler", t, examples=n[0], batch=batch, beams=4, **prof)
    return rec.data


# ------------------------------------------------------------------------------------------------------- the report
def smi_during(samples: list[tuple[float, float, float]], start: float, end: float) -> dict[str, Any]:
    """Mean and max GPU utilisation (%) and max memory (MiB) of the samples taken between ``start`` and ``end``."""
    inside = [(u, m) for t, u, m in samples if start <= t <= end]
    if not inside:
        return {"samples": 0}
    util = [u for u, _ in inside]
    return {
        "samples": len(inside),
        "util_mean": round(sum(util) / len(util), 1),
        "util_max": max(util),
        "memory_max_mib": max(m for _, m in inside),
    }


def read_smi(path: Path) -> list[tuple[float, float, float]]:
    """``nvidia-smi --format=csv`` lines: (unix time, utilisation %, memory MiB); a header and units (``--format=csv``
    without ``noheader,nounits``, as the GPU study's sampler writes) are skipped. The stamps are the lent machine's
    clock, UTC (its steps' unix ``started_at`` fall in their samples), read as UTC whatever this machine's zone."""
    samples = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        parts = [p.strip() for p in line.split(",")]
        try:
            stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=UTC).timestamp()
            samples.append((stamp, float(parts[1].split()[0]), float(parts[2].split()[0])))
        except (ValueError, IndexError):
            continue  # a line cut by the sampler's end
    return samples


def _ops_table(rows: list[dict[str, Any]], n: int = 10) -> list[str]:
    lines = ["| operation | calls | device ms | host ms |", "|---|---|---|---|"]
    return lines + [
        f"| `{r['op'][:60]}` | {r['calls']} | {r['self_device_ms']} | {r['self_host_ms']} |" for r in rows[:n]
    ]


HEADINGS = {
    1: "## 1. Today's path on the GPU (`python -m benchmarks.gpu_profile`)",
    3: "## 3. The batched engine's path on the GPU, one run (`python -m benchmarks.gpu_profile --train-only`, "
    "after issue 53's engine was merged)",
}


def markdown(
    data: dict[str, Any], smi: list[tuple[float, float, float]], section: int = 1, spy: dict[str, Any] | None = None
) -> str:
    steps = data["steps"]
    rates = data.get("mm_tflops", {})
    tflop = data.get("round_tflop")
    lines = [
        HEADINGS[section],
        "",
        f"Device: {data['device']} (torch {data['torch']}). One round of fedselectkd (two paths: local and global "
        "adapter) on the GPU study's parameters (configs/gpu-study.yaml: the three full QMSum domain clients, batch "
        "8 x 2 accumulation, top 2 of 6 decoder layers adapted), the real MiniLM-L6 BERT2BERT with random "
        "cross-attention (a speed measurement), trained by `run_set` as the train stage runs it, one run alone.",
        "",
        "| step | wall s | GPU util mean / max % (nvidia-smi, 0.25 s) | GPU memory max MiB |",
        "|---|---|---|---|",
    ]
    for name, s in steps.items():
        u = smi_during(smi, s["start"], s["end"])
        util = f"{u['util_mean']} / {u['util_max']}" if u["samples"] else "-"
        lines.append(f"| {name} | {s['seconds']:.1f} | {util} | {u.get('memory_max_mib', '-')} |")
    prof = steps.get("round_torch_profiler", {})
    if prof and "round_subset" in steps:
        busy, wall = prof["device_busy_s"], steps["round_subset"]["seconds"]
        n_train, n_valid = steps["round_subset"]["train_valid_examples_a_client"]
        lines += [
            "",
            f"The profilers watched a round of the same run on the first {n_train} train and {n_valid} valid "
            f"examples of each client (`round_subset`, {wall:.1f} s unprofiled; their own cost grows with the events "
            f"recorded). The device's kernels ran {busy} s in all during it (their summed time under torch.profiler, "
            f"where it took {prof['wall_s']} s): **{100 * busy / wall:.1f} %** of the round's time without the "
            "profiler; the rest is host work the device waits for.",
        ]
    if tflop and rates and "round" in steps:
        secs = steps["round"]["seconds"]
        lines += [
            "",
            f"The round's matmul arithmetic (`benchmarks/flops.py` at the examples' real lengths) is {tflop} TFLOP; "
            f"`torch.mm` on this device ran at {rates['float32']} TFLOP/s (float32) and {rates['bfloat16']} TFLOP/s "
            f"(bfloat16), so the floor is {tflop / rates['float32']:.3f} s (fp32) / {tflop / rates['bfloat16']:.4f} s "
            f"(bf16): the timed round ({secs:.1f} s) is **{secs / (tflop / rates['float32']):.0f}x** the fp32 floor "
            f"and {secs / (tflop / rates['bfloat16']):.0f}x the bf16 floor. At this speed one command's 540 s hold "
            f"{540 / secs:.0f} rounds of this arm, one run at a time.",
        ]
    if prof:
        lines += ["", "Top operations of the round by device time:", "", *_ops_table(prof["top_by_device"])]
        lines += ["", "... and by host time:", "", *_ops_table(prof["top_by_host"])]
    cp = steps.get("round_cprofile", {})
    if cp:
        lines += [
            "",
            f"Python functions by own time (cProfile of the same subset round, {cp['wall_s']} s under it; cProfile "
            "sees the thread that calls `run_set`, where the set's round barrier runs the clients' work):",
            "",
        ]
        lines += ["| function | calls | own s | cumulative s |", "|---|---|---|---|"]
        lines += [
            f"| `{r['function']}` | {r['calls']} | {r['self_s']} | {r['cum_s']} |" for r in cp["top_by_self"][:10]
        ]
    if spy and spy["samples"]:
        lines += [
            "",
            f"Where the timed round's host time went (py-spy, every thread, 100 samples/s: {spy['samples']} samples; "
            "a frame on top of the stack is where the thread was, inside torch's C++ included):",
            "",
            "| function (own) | samples | % |",
            "|---|---|---|",
            *(f"| `{f[:90]}` | {c} | {100 * c / spy['samples']:.0f} |" for f, c in spy["own"][:12]),
        ]
    evals = {k: v for k, v in steps.items() if k.startswith("evaluate_batch")}
    if evals:
        lines += [
            "",
            "Evaluation (Academic's test set, beam 4, `generate_per_run` as the evaluate stage calls it):",
            "",
        ]
        lines += ["| decoding batch | examples | wall s | examples/s |", "|---|---|---|---|"]
        for name, s in evals.items():
            lines.append(
                f"| {name.removeprefix('evaluate_batch')} | {s['examples']} | {s['seconds']:.1f} | "
                f"{s['examples'] / s['seconds']:.2f} |"
            )
    ev = steps.get("evaluate_torch_profiler", {})
    if ev:
        lines += [
            "",
            f"Under torch.profiler, {ev['examples']} examples at batch {ev['batch']}: {ev['wall_s']} s, the device "
            f"busy {ev['device_busy_s']} s of it ({100 * ev['device_busy_share']:.1f} %, the profiler's own host "
            "cost included). Top operations by host time:",
            "",
            *_ops_table(ev["top_by_host"]),
        ]
    return "\n".join(lines) + "\n"


def replace_section(md: Path, number: int, section: str, title: str) -> None:
    """Put ``section`` (its heading ``## <number>. ...`` first) in place of ``md``'s section ``number``, or after the
    last; the other sections stay."""
    text = md.read_text() if md.exists() else f"# {title}\n"
    before, found, after = text.partition(f"## {number}.")
    rest = after.partition(f"\n## {number + 1}.")[2] if found else ""
    md.write_text(before.rstrip() + "\n\n" + section + (f"\n## {number + 1}." + rest if rest else ""))


def report(src: Path, md: Path, section: int = 1) -> None:
    """Rewrite ``md``'s section ``section`` (1: today's path, 3: the batched engine's) from a returned folder
    (profile.json, smi.csv, pyspy-round.txt when there)."""
    data = json.loads((src / "profile.json").read_text())
    spy = pyspy_top(src / "pyspy-round.txt")
    text = markdown(data, read_smi(src / "smi.csv"), section, spy)
    replace_section(md, section, text, "fedmeet on a lent GPU (issue 54)")


def device_and_measure_parsers(sub, work: Path, budget_s: float) -> tuple[argparse.ArgumentParser, ...]:
    """The ``device`` and ``measure`` subcommands every GPU benchmark of this folder has."""
    dev = sub.add_parser("device", help="the lent machine's one command")
    dev.add_argument("--carry", type=Path, default=Path(".gpu-study/carry"))
    dev.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    dev.add_argument("--work", type=Path, default=work)
    dev.add_argument("--budget", type=float, default=budget_s, help="seconds for the whole command")
    me = sub.add_parser("measure", help="the measurement itself (a child of `device`; --tiny on this CPU)")
    me.add_argument("--qmsum", type=Path, required=True)
    me.add_argument("--out", type=Path, required=True)
    me.add_argument("--work", type=Path, default=None)
    me.add_argument("--tiny", action="store_true")
    return dev, me


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    dev, me = device_and_measure_parsers(sub, Path("/tmp/gpu-profile"), 200)
    dev.add_argument("--tiny", action="store_true", help="measure --tiny (a check of this command on a CPU)")
    dev.add_argument("--train-only", action="store_true", help="measure --train-only")
    me.add_argument("--train-only", action="store_true", help="the two full rounds only (the first fills the cache)")
    rep = sub.add_parser("report", help="reports/bench/gpu.md section 1 from a returned folder")
    rep.add_argument("src", type=Path, nargs="?", default=REPO / "reports" / "bench" / "gpu-profile")
    rep.add_argument("--md", type=Path, default=REPO / "reports" / "bench" / "gpu.md")
    rep.add_argument("--section", type=int, default=1, choices=sorted(HEADINGS))
    args = ap.parse_args(argv)
    if args.command == "device":
        extra = ("--train-only",) if args.train_only else ()
        return device(args.carry.resolve(), args.out.resolve(), args.work, args.budget, args.tiny, extra=extra)
    if args.command == "report":
        report(args.src, args.md, args.section)
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-profile-"))
    data = measure(args.qmsum, args.out.resolve(), work.resolve(), args.tiny, train_only=args.train_only)
    print(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
