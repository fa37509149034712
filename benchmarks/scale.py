"""Scale of the federated engine (issue 13 item 6): wall time and peak memory per round of the in-process engine
as the number of clients grows.

    python -m benchmarks.scale              # 3, 10, 30, 100 clients -> reports/bench/scale.{json,png}
    python -m benchmarks.scale --sizes 3 10 --out /tmp/scale

Each (engine, clients) point trains FedAvg for a few rounds on the tiny BART of tests/tiny_models.py, over a
``quantity`` (Dirichlet) partition made by ``pipeline.partitioning.partitions.make_partition`` of a synthetic QMSum-like
pool of a few examples per client. Every point runs in its own fresh Python process, so one point's allocations do not
raise the next one's high-water mark, and a point that hangs is killed after ``--timeout`` seconds and recorded as
skipped with the reason.

Per round: the server's round time (``RoundLog.seconds``) and two peaks, both reset at every round boundary:
- ``driver_peak_mb``: the kernel's RSS high-water mark (VmHWM, reset by writing 5 to /proc/self/clear_refs) of
  the process running the server; with the in-process engine that is every client too, and no peak is missed;
- ``driver_growth_mb``: that peak minus the driver's RSS just before the run (imports and the process's fixed
  cost excluded), the part that could grow with the clients;
- ``tree_peak_mb``: the largest sum of RSS over that process and all its descendants, sampled every 20 ms by
  psutil (the in-process engine starts none: a child process here would be a defect). RSS counts shared pages once
  per process, so with children this would be an upper bound on the physical memory used.
Round 1 is reported apart (it loads the model and builds the caches); the per-round time is the
median of rounds 2.. . The fitted exponent is the least-squares slope of log(median per-round value) on log(clients): 1
is linear.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import numpy as np  # noqa: E402

from tests.tiny_models import DOMAINS, MODEL, WORDS  # noqa: E402  (the tests' tiny workspace)

SIZES = (3, 10, 30, 100)
QUICK_SIZES = (3, 10)
ENGINES = ("inprocess",)
LINEAR_TOLERANCE = 0.1  # fitted slopes up to 1.1 count as linear: two rounds on a shared machine are noisy
BACKBONE = "tiny BART (tests/tiny_models.py: d_model 32, 2 encoder / 4 decoder layers)"


@dataclass
class ScaleConfig:
    sizes: tuple[int, ...] = SIZES
    engines: tuple[str, ...] = ENGINES
    rounds: int = 5  # round 1 carries the one-off start-up; the median of rounds 2..5 the steady cost (with
    # only rounds 2..3 the in-process slope read 1.11 on a load-8 machine, 1.05 with 2..5)
    train_per_client: int = 2  # pool size per split = this x clients; Dir(beta) decides who gets how many
    eval_per_client: int = 1  # valid and test examples per client on average (every client gets >= 1)
    beta: float = 50.0  # quantity skew; large enough that a draw giving every client one valid example is found
    seed: int = 0
    timeout_s: float = 120.0  # per (engine, clients) point, startup included
    threads: int = 1


# ------------------------------------------------------------------------------------------- workspace
def _examples(n_clients: int, cfg: ScaleConfig):
    import pandas as pd

    rows = []
    for split, per in (("train", cfg.train_per_client), ("valid", cfg.eval_per_client), ("test", cfg.eval_per_client)):
        for i in range(per * n_clients):
            dom = DOMAINS[i % len(DOMAINS)]
            rows.append(
                {
                    "example_id": f"{split}/m{i}",
                    "dataset": "qmsum",
                    "domain": dom,
                    "split": split,
                    "meeting_id": f"{split}-m{i}",
                    "source": f"What was said? #SEP# A: {WORDS[i % 5]}. B: {WORDS[(i + 2) % 5]}.",
                    "target": WORDS[i % 5] + ".",
                }
            )
    return pd.DataFrame(rows)


def make_workspace(
    root: Path,
    n_clients: int,
    engine: str,
    cfg: ScaleConfig,
    backbone: Path,
    name: str | None = None,
    train: dict[str, Any] | None = None,
    privacy: dict[str, Any] | None = None,
) -> str:
    """A repo-like directory for one point (examples, quantity partition, plan); returns the plan path. ``name``,
    ``train`` (overrides) and ``privacy`` (the params group): another plan on the same pool (benchmarks.client_dp)."""
    from pipeline.partitioning.partitions import make_partition, partition_json
    from pipeline.partitioning.schemes import PartitionConfig, QuantityConfig
    from pipeline.planning import parse_entry, resolve_plan

    root.mkdir(parents=True, exist_ok=True)
    (root / "models").mkdir(exist_ok=True)
    link = root / "models" / "backbone"
    if not link.exists():
        link.symlink_to(backbone.resolve(), target_is_directory=True)
    examples = _examples(n_clients, cfg)
    (root / "data" / "processed").mkdir(parents=True, exist_ok=True)
    examples.to_parquet(root / "data" / "processed" / "examples.parquet", index=False)
    pcfg = PartitionConfig(quantity=QuantityConfig(n_clients=n_clients, beta=cfg.beta, min_per_split=1))
    part = make_partition(examples, "quantity", cfg.seed, pcfg)
    ppath = root / "data" / "partitions" / "quantity" / f"seed{cfg.seed}.json"
    ppath.parent.mkdir(parents=True, exist_ok=True)
    ppath.write_text(json.dumps(partition_json(part, "quantity", cfg.seed, pcfg)))
    train = {"rounds": cfg.rounds, "batch_size": 4, "lr": 5.0e-3, **(train or {})}
    # the partition group too: the plan declares the scheme's clients (n_clients of them) from it
    params = {
        "tau": 5.0,
        "model": MODEL,
        "train": train,
        "partition": asdict(pcfg),
        **({"privacy": privacy} if privacy else {}),
    }
    name = name or f"scale-{engine}-{n_clients}"
    entry = parse_entry(
        name, {"method": "fedavg", "partition": f"quantity/seed{cfg.seed}", "seed": cfg.seed, "study": "bench"}, params
    )
    plan = resolve_plan(entry, params)
    path = root / "models" / "plans" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2, sort_keys=True))
    return str(path.relative_to(root))


# --------------------------------------------------------------------------------------------- memory
def _vm_hwm_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    """Reset this process's RSS high-water mark (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class TreeSampler(threading.Thread):
    """Largest summed RSS of this process and its descendants since the last ``take()``."""

    def __init__(self, interval_s: float = 0.02):
        super().__init__(daemon=True)
        import psutil

        self.proc = psutil.Process()
        self.interval_s = interval_s
        self.peak = 0
        self.max_processes = 1
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def sample(self) -> None:
        import psutil

        procs = [self.proc] + self.proc.children(recursive=True)
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass  # a worker that ended between the listing and the read
        with self._lock:
            self.peak = max(self.peak, total)
            self.max_processes = max(self.max_processes, len(procs))

    def run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def take(self) -> tuple[float, int]:
        self.sample()  # the round boundary itself
        with self._lock:
            peak, n = self.peak, self.max_processes
            self.peak, self.max_processes = 0, 1
        return peak / 2**20, n

    def stop(self) -> None:
        self._stop.set()


# ---------------------------------------------------------------------------------------------- points
@contextmanager
def _in_workspace(root: Path):
    old_cwd, old_root = os.getcwd(), os.environ.get("FEDMEET_ROOT")
    os.chdir(root)
    os.environ["FEDMEET_ROOT"] = str(root)
    try:
        yield
    finally:
        os.chdir(old_cwd)
        if old_root is None:
            os.environ.pop("FEDMEET_ROOT", None)
        else:
            os.environ["FEDMEET_ROOT"] = old_root


def measure(engine: str, n_clients: int, root: Path, cfg: ScaleConfig, backbone: Path) -> dict[str, Any]:
    """Run one (engine, clients) point in this process; returns its per-round rows."""
    import torch

    from pipeline.experiments.settings import RunSettings
    from pipeline.federation.engines import run_federated

    torch.set_num_threads(cfg.threads)
    root = Path(root)
    plan_path = make_workspace(root, n_clients, engine, cfg, backbone)
    sampler = TreeSampler()
    hwm_resettable = _reset_hwm()
    rounds: list[dict[str, Any]] = []

    class Timer:  # the rounds recorder run_federated calls
        def started(self, plan, clients, start_round):
            self.n_clients = len(clients)
            _reset_hwm()
            sampler.take()
            self.t = time.perf_counter()

        def round_done(self, plan, entry, history):
            now = time.perf_counter()
            tree_mb, n_procs = sampler.take()
            rounds.append(
                {
                    "round": entry.round,
                    "seconds": round(entry.seconds, 4),
                    "wall_seconds": round(now - self.t, 4),
                    "driver_peak_mb": round(_vm_hwm_mb() or float("nan"), 1),
                    "tree_peak_mb": round(tree_mb, 1),
                    "processes": n_procs,
                    "driver_growth_mb": round((_vm_hwm_mb() or float("nan")) - baseline_mb, 1),
                    "clients_replied": len(entry.rows),
                }
            )
            _reset_hwm()
            self.t = time.perf_counter()

    timer = Timer()
    # RSS before the run (torch, flwr, the tiny model's modules imported): what a round adds is peak - this
    baseline_mb = sampler.proc.memory_info().rss / 2**20
    t0 = time.perf_counter()
    sampler.start()
    try:
        with _in_workspace(root):
            run_federated(plan_path, RunSettings(), timer)
    finally:
        sampler.stop()
    partition = json.loads((root / "data" / "partitions" / "quantity" / f"seed{cfg.seed}.json").read_text())
    train_sizes = [len(c["train"]) for c in partition["clients"].values()]
    if len(rounds) != cfg.rounds:
        raise RuntimeError(f"{engine} with {n_clients} clients finished {len(rounds)} of {cfg.rounds} rounds")
    return {
        "engine": engine,
        "clients": n_clients,
        "status": "ok",
        "rounds": rounds,
        "total_seconds": round(time.perf_counter() - t0, 2),
        "train_examples": int(sum(train_sizes)),
        "train_per_client_min": int(min(train_sizes)),
        "train_per_client_max": int(max(train_sizes)),
        "hwm_reset_per_round": hwm_resettable,
        # round 1 also pays one-off costs (the model loads, the caches fill): steady state is rounds 2..
        "first_round_seconds": rounds[0]["seconds"],
        "median_round_seconds": float(np.median([r["seconds"] for r in rounds[1:] or rounds])),
        "median_driver_peak_mb": float(np.median([r["driver_peak_mb"] for r in rounds])),
        "median_tree_peak_mb": float(np.median([r["tree_peak_mb"] for r in rounds])),
        "baseline_rss_mb": round(baseline_mb, 1),
        "median_driver_growth_mb": float(np.median([r["driver_growth_mb"] for r in rounds])),
    }


def measure_subprocess(engine: str, n_clients: int, root: Path, cfg: ScaleConfig, backbone: Path) -> dict[str, Any]:
    """``measure`` in a fresh interpreter, killed (whole process group) after ``cfg.timeout_s``."""
    out = root / "point.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.scale",
        "--point",
        engine,
        str(n_clients),
        "--workspace",
        str(root),
        "--backbone",
        str(backbone),
        "--config",
        json.dumps(asdict(cfg)),
        "--point-out",
        str(out),
    ]
    log = root / "point.log"
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {
                "engine": engine,
                "clients": n_clients,
                "status": "skipped",
                "reason": f"exceeded the {cfg.timeout_s:.0f} s bound per point (killed)",
            }
    if rc != 0 or not out.exists():
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        return {
            "engine": engine,
            "clients": n_clients,
            "status": "skipped",
            "reason": f"exit {rc} after {time.perf_counter() - t0:.0f} s: {tail[0][:300]}",
        }
    result = json.loads(out.read_text())
    result["process_seconds"] = round(time.perf_counter() - t0, 2)
    return result


def fit_exponent(sizes: list[int], values: list[float]) -> float | None:
    """Least-squares slope of log(value) on log(clients); None with fewer than two positive points."""
    pts = [(n, v) for n, v in zip(sizes, values) if v and v > 0 and np.isfinite(v)]
    if len(pts) < 2:
        return None
    x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return round(float(np.polyfit(x, y, 1)[0]), 3)


METRICS = {
    "median_round_seconds": "s per round (median of rounds 2..)",
    "first_round_seconds": "s of round 1",
    "median_driver_peak_mb": "driver peak RSS (MiB)",
    "median_tree_peak_mb": "process-tree peak RSS (MiB)",
    "median_driver_growth_mb": "driver peak above its pre-run RSS (MiB)",
}


def summarise(points: list[dict[str, Any]], engines: tuple[str, ...]) -> dict[str, Any]:
    fits: dict[str, Any] = {}
    for engine in engines:
        ok = sorted((p for p in points if p["engine"] == engine and p["status"] == "ok"), key=lambda p: p["clients"])
        sizes = [p["clients"] for p in ok]
        fits[engine] = {"sizes": sizes}
        for key in METRICS:
            values = [p[key] for p in ok]
            slope = fit_exponent(sizes, values)
            # the slope between the two largest sizes: fixed per-round costs flatten the overall fit at small
            # sizes, so a superlinear term would show here first
            fits[engine][key] = {
                "exponent": slope,
                "tail_exponent": fit_exponent(sizes[-2:], values[-2:]),
                "at_most_linear": None if slope is None else slope <= 1 + LINEAR_TOLERANCE,
            }
    return fits


def bench_scale(cfg: ScaleConfig, work: Path | None = None, isolate: bool = True, progress=None) -> dict[str, Any]:
    """Every (engine, clients) point of ``cfg``; ``isolate`` runs each in a fresh process (the benchmark), else in
    this one (the test)."""
    from tests.tiny_models import save_tiny

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedmeet-scale-") as tmp:
        base = Path(work or tmp)
        backbone = base / "backbone"
        if not backbone.exists():
            save_tiny("bart", backbone)
        points = []
        for engine in cfg.engines:
            for n in cfg.sizes:
                root = base / f"{engine}-{n}"
                run = measure_subprocess if isolate else measure
                points.append(run(engine, n, root, cfg, backbone))
                if progress:
                    progress(f"{engine} {n} clients: {points[-1]['status']}")
    return {
        "config": asdict(cfg),
        "backbone": BACKBONE,
        "method": "fedavg",
        "partition": "quantity (Dirichlet)",
        "points": points,
        "fits": summarise(points, cfg.engines),
        "linear_tolerance": LINEAR_TOLERANCE,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = res["config"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, keys, label in (
        (axes[0], ["median_round_seconds"], "seconds per round (median of rounds 2..)"),
        (axes[1], ["median_driver_peak_mb", "median_tree_peak_mb"], "peak RSS per round (MiB)"),
    ):
        for engine in cfg["engines"]:
            ok = sorted(
                (p for p in res["points"] if p["engine"] == engine and p["status"] == "ok"), key=lambda p: p["clients"]
            )
            if not ok:
                continue
            for key in keys:
                slope = res["fits"][engine][key]["exponent"]
                what = "" if len(keys) == 1 else (" driver" if "driver" in key else " process tree")
                ax.plot(
                    [p["clients"] for p in ok],
                    [p[key] for p in ok],
                    marker="o",
                    linestyle="-" if "tree" not in key else "--",
                    label=f"{engine}{what} (slope {slope})",
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("clients")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"FedAvg scale: {res['backbone']}; quantity Dir({cfg['beta']}) partition, "
        f"n = {cfg['train_per_client']} train examples per client on average, {cfg['rounds']} rounds",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--rounds", type=int, default=ScaleConfig.rounds)
    ap.add_argument("--timeout", type=float, default=ScaleConfig.timeout_s, help="seconds per point")
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    ap.add_argument("--point", nargs=2, metavar=("ENGINE", "CLIENTS"), help=argparse.SUPPRESS)
    ap.add_argument("--workspace", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--backbone", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--point-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.point:  # child of measure_subprocess
        raw = json.loads(args.config)
        cfg = ScaleConfig(**{**raw, "sizes": tuple(raw["sizes"]), "engines": tuple(raw["engines"])})
        result = measure(args.point[0], int(args.point[1]), args.workspace, cfg, args.backbone)
        args.point_out.write_text(json.dumps(result))
        return
    cfg = ScaleConfig(sizes=tuple(args.sizes), engines=tuple(args.engines), rounds=args.rounds, timeout_s=args.timeout)
    res = bench_scale(cfg, progress=print)
    write(res, args.out)
    print(f"scale benchmark written to {args.out}/scale.json and scale.png in {res['seconds']:.0f} s")


def write(res: dict[str, Any], out: Path) -> None:
    """scale.json + scale.png, and README.md re-rendered when the other benchmarks' JSON files are there."""
    from benchmarks import readme
    from benchmarks.common import write_json

    if "meta" not in res:  # standalone run; benchmarks.run passes its own meta
        import platform

        from benchmarks.run import _cpu_name

        res = {
            "meta": {
                "profile": "scale",
                "threads": res["config"]["threads"],
                "cpu": _cpu_name(),
                "cpu_count": os.cpu_count(),
                "python": platform.python_version(),
                "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                "seconds": res["seconds"],
            },
            **res,
        }
    write_json(out / "scale.json", res)
    plot(res, out / "scale.png")
    if (out / "train_step.json").exists():
        from benchmarks.run import load_results

        readme.write(load_results(out), out / "README.md")


if __name__ == "__main__":
    main()
