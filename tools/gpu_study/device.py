"""The study on a lent GPU machine, in one command: the stages of dvc.yaml in their order, without DVC.

    python3 -m tools.gpu_study.device run --carry .gpu-study/carry --out "$OUT" --budget B   # from the repo root

The machine has Python 3.12, PyTorch, transformers, pandas, pyarrow and scipy, but no DVC, MLflow, Flower, pydantic,
rouge-score, weights, data or network. This module imports only the standard library itself; every stage runs in a
child ``python`` as dvc.yaml's command for it (``python -m pipeline.<stage> ...``), in dependency order:

1. the carried wheels (``tools/gpu_study/prepare.py``) installed with ``pip install --no-index`` into a folder of
   their own (``<work>/site``, first on the children's PYTHONPATH);
2. a scratch workspace ``<work>/repo``: ``pipeline/`` and ``params.yaml`` of this checkout, the profile merged into
   its params.yaml (:func:`merge_profile`: what ``dvc exp run -S`` makes of it), the carried raw datasets under
   ``data/raw/``;
3. ``ingest`` (each dataset of ``ingest.datasets``), ``examples``, ``partition`` (each scheme x seed), ``backbone``
   (the offline recipe from the carried MiniLM files: FEDMEET_MINILM_DIR), ``plan``; once SAMSum is ingested (the
   backbone's one input) the backbone's warm-up on the GPU runs beside the other data stages on the CPU
   (:func:`stage_lanes`), as ``make repro`` runs them;
4. ``train`` with every experiment of the profile in one call (``--experiment A --experiment B ...``, ``--no-mlflow``:
   the MLflow runs are made at the import), or with ``--train-processes`` n, n such calls side by side, each with a
   set of the arms (``train@1``, ...);
5. ``evaluate`` of those experiments in one process (the stage's library function under the stage's timer: one
   backbone load and CUDA start instead of one per experiment; decoding batch size is ``evaluate.batch_size``); with
   n sets, each set's ``evaluate@i`` right after its ``train@i``, while the other sets still train;
6. the outputs (without weights) packed into at most 8 files under ``--out``, whatever happened before: a step that
   fails or outruns ``--budget`` is stopped, recorded in ``study.json`` and the steps after it are skipped
   (study.json is also written under ``--out`` as each step starts and ends: a call killed past its limit returns it).

With ``--detach W`` the study runs in a process of its own session, which the machine keeps running after the call
returns (the tool ends a call's other processes, not a new session's); the call waits W seconds for it, then returns
the files if it ended, else a snapshot of its record and results so far. A later call on the same warm machine
(``wait``, no carry) waits for it and returns its files (:func:`collect`). The study then runs through the gap
between the calls and never stops for one: no round or evaluation cut and redone, no second start of the train
processes; its budget is the lease's time left, not one call's 600 s.

A later call on the same warm machine (``run --resume``, no carry) goes on where the last one stopped: the steps
it finished stay done, ``train`` resumes every run from its last round checkpoint, then ``evaluate`` (the sets'
lanes side by side again, each with what is left of it); study.json
keeps the earlier calls' records under ``earlier_calls``. One lease's 15 minutes hold the staging call, a 600 s
call and a resumed call of the rest.

The same function runs the tiny CPU profile (tests/test_gpu_study.py); only the carry and the profile differ.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "configs/gpu-study.yaml"
REPLACED_WHOLE = ("experiments",)  # as pipeline.presets: a profile's experiments replace params.yaml's
PIECE = 15 * 1024 * 1024  # each returned file at most this (a tar.gz cut into parts when larger)
MAX_FILES = 8
RESERVE_S = 20  # kept for packing the results when the budget is cut
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")
STAGE_DIR = Path("/tmp/gpu-study-stage")  # parts of the carry sent by an earlier call (outside the synced tree)
CODE = ("pipeline", "tools")  # what make_workspace copies of the checkout: the code the stages run


# --------------------------------------------------------------------------- the MiniLM weights, packed for travel
def pack_weights(blob: bytes) -> tuple[bytes, dict[str, Any]]:
    """A float32 safetensors file, losslessly smaller: its tensor bytes split into the 4 byte planes of the
    little-endian floats, the sign-and-exponent plane xz-compressed (~22 -> ~9 MB for MiniLM-L6; the mantissa
    planes barely compress and travel as they are). Returns the packed bytes and what :func:`unpack_weights` needs."""
    import numpy as np

    head = 8 + int.from_bytes(blob[:8], "little")
    body = np.frombuffer(blob, dtype=np.uint8, offset=head)
    if len(body) % 4:
        raise ValueError(f"safetensors body of {len(body)} bytes: not float32 words")
    planes = body.reshape(-1, 4).T
    packed = (
        blob[:head] + b"".join(planes[i].tobytes() for i in range(3)) + lzma.compress(planes[3].tobytes(), preset=1)
    )
    return packed, {"head_bytes": head, "words": len(body) // 4, "sha256": hashlib.sha256(blob).hexdigest()}


def unpack_weights(packed: bytes, info: dict[str, Any]) -> bytes:
    import numpy as np

    head, n = info["head_bytes"], info["words"]
    words = np.empty((n, 4), dtype=np.uint8)
    for i in range(3):
        words[:, i] = np.frombuffer(packed, dtype=np.uint8, count=n, offset=head + i * n)
    words[:, 3] = np.frombuffer(lzma.decompress(packed[head + 3 * n :]), dtype=np.uint8)
    blob = packed[:head] + words.tobytes()
    if hashlib.sha256(blob).hexdigest() != info["sha256"]:
        raise SystemExit(f"MiniLM weights: sha256 {hashlib.sha256(blob).hexdigest()} is not {info['sha256']}")
    return blob


def assemble_minilm(carry: Path, stage_dir: Path, dest: Path) -> Path:
    """The MiniLM folder from the carry's small files and the weights' parts (some staged by an earlier call)."""
    manifest = json.loads((carry / "manifest.json").read_text())["weights"]
    parts = []
    for name in manifest["parts"]:
        found = [d / name for d in (carry, stage_dir) if (d / name).is_file()]
        if not found:
            raise SystemExit(f"{name}: not in {carry} nor {stage_dir} (send the staging call first)")
        parts.append(found[0].read_bytes())
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(carry / "minilm", dest)
    (dest / "model.safetensors").write_bytes(unpack_weights(b"".join(parts), manifest))
    return dest


def stage(folder: Path, stage_dir: Path = STAGE_DIR) -> None:
    """A staging call: keep ``folder``'s parts on the machine for the study's call."""
    if not (parts := sorted(folder.glob("weights.part*"))):  # a folder that did not travel (not in the call's carry)
        raise SystemExit(f'{folder}: no weights.part* to stage (carry it: carry ["{folder}"])')
    stage_dir.mkdir(parents=True, exist_ok=True)
    for f in parts:
        shutil.copy(f, stage_dir / f.name)
        print(f"staged {f.name} ({f.stat().st_size / 2**20:.1f} MiB) in {stage_dir}")


def merge_profile(params: dict[str, Any], profile: dict[str, Any], top: bool = True) -> dict[str, Any]:
    """``params`` with ``profile`` merged in place: mappings key by key, leaves and lists replaced, ``experiments``
    replaced whole (the semantics of ``pipeline.presets.apply_preset``, without DVC's override parser)."""
    for key, value in profile.items():
        if isinstance(value, dict) and isinstance(params.get(key), dict) and not (top and key in REPLACED_WHOLE):
            merge_profile(params[key], value, top=False)
        else:
            params[key] = value
    return params


def merged_params(repo: Path, profile: Path) -> dict[str, Any]:
    """``repo``'s params.yaml with the study ``profile`` merged (merge_profile): what a workspace runs."""
    import yaml  # PyYAML: on the lent image (transformers needs it)

    return merge_profile(yaml.safe_load((repo / "params.yaml").read_text()), yaml.safe_load(profile.read_text()))


def train_sets(experiments: list[str], processes: int) -> list[list[str]]:
    """The experiments cut into ``processes`` sets, each a train process: whole arms (every seed of an arm in one
    set, so a client's seeds still stack in one group), dealt round-robin in the profile's order."""
    arms: dict[str, list[str]] = {}
    for e in experiments:
        arms.setdefault(re.sub(r"-s\d+$", "", e), []).append(e)
    sets: list[list[str]] = [[] for _ in range(min(processes, len(arms)))]
    for i, runs in enumerate(arms.values()):
        sets[i % len(sets)] += runs
    return sets


def stage_commands(params: dict[str, Any], train_processes: int = 1) -> list[tuple[str, list[str]]]:
    """(step, argv after ``python``) of dvc.yaml's stages the study needs, in dependency order; with
    ``train_processes`` > 1 the experiments train in that many processes side by side (``train@1``, ...): the host
    work each set does between its GPU calls runs on its own core while the others' kernels use the GPU. Each set's
    experiments are evaluated as soon as it has trained (``evaluate@1``, ...: the evaluate stage's work for them in
    one process), while the other sets still train: the GPU they leave idle decodes, and a call the budget cuts
    still returns the evaluations of the sets that finished."""
    steps: list[tuple[str, list[str]]] = [
        (f"ingest@{ds}", ["-m", "pipeline.ingest", "--dataset", ds]) for ds in params["ingest"]["datasets"]
    ]
    steps.append(("examples", ["-m", "pipeline.examples"]))
    part = params["partition"]
    steps += [
        (f"partition@{scheme}-{seed}", ["-m", "pipeline.partition", "--scheme", scheme, "--seed", str(seed)])
        for scheme in part["schemes"]
        for seed in part["seeds"]
    ]
    steps.append(("backbone", ["-m", "pipeline.backbone"]))
    steps.append(("plan", ["-m", "pipeline.plan"]))
    sets = train_sets(list(params["experiments"]), train_processes)
    for i, runs in enumerate(sets, start=1):
        flags = [a for e in runs for a in ("--experiment", e)]
        at = "" if len(sets) == 1 else f"@{i}"
        steps.append((f"train{at}", ["-m", "pipeline.train", *flags, "--no-mlflow"]))
        steps.append((f"evaluate{at}", ["-m", "tools.gpu_study.device", "evaluate", *flags]))
    return steps


BACKBONE_INPUT = "ingest@samsum"  # the backbone stage's one dependency (dvc.yaml)


def stage_lanes(
    steps: list[tuple[str, list[str]]],
) -> tuple[list[tuple[str, list[str]]], list[list[tuple[str, list[str]]]], list[tuple[str, list[str]]]]:
    """:func:`stage_commands` as: what comes first (the backbone's input), two lanes that run side by side (the
    backbone; the other data stages) and what comes after both (plan, train, evaluate), each in its order."""
    names = [name for name, _ in steps]
    if "backbone" not in names:  # a resumed call's: what is left, the sets still side by side
        return [], [], steps
    cut = names.index("backbone")
    before = [s for s in steps if s[0] == BACKBONE_INPUT]
    data = [s for s in steps[:cut] if s[0] != BACKBONE_INPUT]
    return before, [[steps[cut]], data], steps[cut + 1 :]


FINISHED = {"train": "models/{}/metrics.json", "evaluate": "reports/eval/{}/metrics.json"}  # each written last


def left_to_do(step: tuple[str, list[str]], repo_dir: Path) -> tuple[str, list[str]] | None:
    """``step`` as a resumed call runs it: ``train`` or ``evaluate`` without the experiments an earlier call finished
    (their :data:`FINISHED` record written; None when that is all of them); the runs it cut resume from their
    checkpoints, and the evaluations it cut start again, stacked with fewer runs (a run's scores do not depend on the
    runs beside it: tests/test_evaluate.py)."""
    name, argv = step
    finished_record = FINISHED.get(name.split("@")[0])
    if finished_record is None:
        return step
    pairs = {i: argv[i + 1] for i, a in enumerate(argv) if a == "--experiment"}
    finished = {i for i, e in pairs.items() if (repo_dir / finished_record.format(e)).is_file()}
    if len(finished) == len(pairs):
        return None
    return name, [a for i, a in enumerate(argv) if i not in finished and i - 1 not in finished]


def evaluate_all(experiments: list[str], params_path: str = "params.yaml") -> None:
    """The evaluate stage's body (pipeline.evaluate main, ``run --no-mlflow``) for every experiment in one process:
    one backbone load and CUDA start, every experiment's client adapters stacked in the same generate calls
    (pipeline.results.experiment_evaluation.evaluate_experiments), under one timing record named like the train
    call's."""
    from pipeline.common.config import from_dict, load_params
    from pipeline.common.timing import stage_name, stage_timer
    from pipeline.results.evaluation import EvaluateConfig
    from pipeline.results.experiment_evaluation import evaluate_experiments
    from pipeline.results.stats import BootstrapConfig

    params = load_params(params_path)
    cfg = from_dict(EvaluateConfig, params.get("evaluate"), "evaluate")
    bootstrap = from_dict(BootstrapConfig, params.get("bootstrap"), "bootstrap")
    with stage_timer(stage_name("evaluate", experiments), experiments=experiments):
        evaluate_experiments(experiments, cfg, mlflow_logging=False, bootstrap=bootstrap)


# Each installed wheel's requirements against what a stage imports (``argv[1]``, the carried site, first; then the
# image's): the unmet ones, a JSON list of [the required package's name, a line saying what is unmet]. Not those of
# an extra, nor of the packages ``argv[2:]`` the study never runs.
UNMET = """
import importlib.metadata as md, json, sys
from packaging.requirements import Requirement
unmet = []
for dist in md.distributions(path=[sys.argv[1]]):
    for req in map(Requirement, dist.requires or []):
        if req.name in sys.argv[2:] or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            unmet.append([req.name, f"{dist.name} {dist.version} needs {req}, here {req.name} {have or '(none)'}"])
print(json.dumps(sorted(unmet, key=lambda u: u[1])))
"""
UNUSED = ("uv",)  # required by flwr, never run by the study (tools/gpu_study/prepare.py does not carry it)


def install_wheels(wheels: Path, site: Path, log) -> int | str:
    """0, or pip's status, or the carried wheels' requirements the image's packages do not meet (a protobuf outside
    flwr's pins would fail only at the train step's first import of flwr, after the data stages and the backbone).
    Where the image's version of a package is outside the pins and ``wheels/spare`` holds the pinned one (small
    pure-Python packages the image has, carried in case its versions move: prepare.py), the spare is installed too
    and the requirements checked again (a spare's own too, until no spare is left to help)."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        print(f"no wheels in {wheels}: the current Python's packages are used", file=log, flush=True)
        return 0
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target"]
    if rc := subprocess.run([*cmd, str(site), *map(str, found)], stdout=log, stderr=subprocess.STDOUT).returncode:
        return rc
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    check = [sys.executable, "-c", UNMET, str(site), *UNUSED]
    unmet = json.loads(subprocess.run(check, env=env, capture_output=True, text=True, check=True).stdout)
    spares = {norm(w.name.split("-")[0]): w for w in sorted((wheels / "spare").glob("*.whl"))}
    installed: set[Path] = set()
    # again until no spare is left to help: an installed spare's own pins may miss the image's versions in turn
    while needed := sorted({spares[norm(name)] for name, _ in unmet if norm(name) in spares} - installed):
        print(f"the image's versions outside the pins; installing the spares {[w.name for w in needed]}", file=log)
        if rc := subprocess.run([*cmd, str(site), *map(str, needed)], stdout=log, stderr=subprocess.STDOUT).returncode:
            return rc
        installed.update(needed)
        unmet = json.loads(subprocess.run(check, env=env, capture_output=True, text=True, check=True).stdout)
    return "; ".join(line for _, line in unmet) or 0


def norm(name: str) -> str:
    """A distribution's normalised name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def make_workspace(repo: Path, work: Path, carry: Path, profile: Path) -> dict[str, Any]:
    """``work`` with the package, the merged params.yaml and the raw data; returns the merged params."""
    import yaml  # PyYAML: on the lent image (transformers needs it)

    if work.exists():
        shutil.rmtree(work)
    for top in CODE:
        shutil.copytree(repo / top, work / top, ignore=shutil.ignore_patterns("__pycache__"))
    params = merged_params(repo, profile)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False, width=4096))
    with tarfile.open(carry / "raw.tar.gz") as tar:
        tar.extractall(work / "data/raw", filter="data")
    return params


def child_env(work: Path, site: Path, minilm: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(site), str(work), env.get("PYTHONPATH", "")) if p),
        FEDMEET_ROOT=str(work),
        FEDMEET_MINILM_DIR=str(minilm),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        FLWR_TELEMETRY_ENABLED="0",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.pop("FEDMEET_DATA_ROOT", None)  # the workspace's data/raw, as ingest.data_root says
    return env


def device_info() -> dict[str, Any]:
    """The accelerator as nvidia-smi names it (none on a CPU)."""
    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    if shutil.which("nvidia-smi"):
        q = "--query-gpu=name,memory.total,driver_version"
        out = subprocess.run(["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True)
        info["gpu"] = out.stdout.strip()
    return info


def pack(out: Path, name: str, members: list[tuple[Path, str]]) -> list[Path]:
    """``members`` (path, name in the archive) as ``name`` (tar.gz), cut into PIECE-sized parts when larger."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, arcname in members:
            tar.add(path, arcname=arcname)
    data = buf.getvalue()
    if len(data) <= PIECE:
        (out / name).write_bytes(data)
        return [out / name]
    files = []
    for i in range(0, len(data), PIECE):
        files.append(out / f"{name}.part{i // PIECE + 1}")
        files[-1].write_bytes(data[i : i + PIECE])
    return files


def pack_work(work: Path, out: Path) -> list[Path]:
    """``work``'s log.tar.gz (the log, the GPU samples, py-spy's stacks) and results.tar.gz (:func:`results_members`
    of its workspace, once the workspace has its params.yaml) under ``out``."""
    logs = (work / "log.txt", work / "gpu.csv", *sorted(work.glob("pyspy-train*.txt")))
    files = pack(out, "log.tar.gz", [(p, p.name) for p in logs if p.is_file()])
    repo_dir = work / "repo"
    return files + pack(
        out, "results.tar.gz", results_members(repo_dir) if (repo_dir / "params.yaml").is_file() else []
    )


def written(path: Path, work: Path) -> bool:
    """Not a temporary of a write in progress, or one a killed step left (pipeline.common.atomic: ``.<name>.<pid>.
    <hex>.tmp``, a run published from ``models/.<exp>...tmp/``): a snapshot of a detached study packs while the
    stages write, and such a file is renamed away before it is read, or read as a run of its own by the import."""
    return not any(part.startswith(".") for part in path.relative_to(work).parts)


def weights_md5(work: Path) -> Path:
    """``weights.md5.json``: the md5 of every weights file the run wrote (they stay on the machine)."""
    models = work / "models"
    found = (
        sorted(p for p in models.rglob("*") if p.name.endswith(WEIGHTS) and written(p, work)) if models.is_dir() else []
    )
    path = work / "weights.md5.json"
    digests = {p.relative_to(work).as_posix(): hashlib.md5(p.read_bytes()).hexdigest() for p in found}
    path.write_text(json.dumps(digests, indent=1) + "\n")
    return path


def results_members(work: Path) -> list[tuple[Path, str]]:
    """What the run wrote that the import reads: params.yaml, plans and run records without weights, every report;
    the gate logs stay (client token ids, ~0.7 MiB a KD run's round: the study's far exceed what a call returns)."""
    members = [(work / "params.yaml", "params.yaml"), (weights_md5(work), "weights.md5.json")]
    for top in ("models", "reports", "data/partitions"):
        base = work / top
        if base.is_dir():
            members += [
                (p, p.relative_to(work).as_posix())
                for p in sorted(base.rglob("*"))
                if p.is_file()
                and written(p, work)
                and not p.name.endswith(WEIGHTS)
                and "/backbone/" not in p.as_posix()
                and not p.name.startswith("gate_log")
            ]
    return members


class Steps:
    """The call's steps within its budget (seconds from ``t0``), each recorded in ``record["steps"]``; with a
    ``py_spy`` executable, each train step's threads are sampled into ``<work>/pyspy-<step>.txt``; with ``saved``,
    the record so far is written to each of those files as each step starts and ends (a call killed at its limit
    still returns it under $OUT, and a resumed call finds it in ``work``)."""

    def __init__(self, record: dict[str, Any], log, budget_s: float, t0: float, py_spy: Path | None = None, saved=()):
        self.record, self.log, self.budget_s, self.t0, self.py_spy = record, log, budget_s, t0, py_spy
        self.saved, self.lock = saved, threading.Lock()

    def save(self) -> None:
        with self.lock:  # the lanes' threads
            text = json.dumps(self.record | {"seconds": round(time.monotonic() - self.t0, 2), "complete": False})
            for path in self.saved:
                path.with_suffix(".tmp").write_text(text + "\n")
                path.with_suffix(".tmp").replace(path)

    def child(self, argv: list[str], cwd: Path, env: dict[str, str], left: float, sampled: Path | None) -> int:
        """A stage command in a child ``python``, killed when ``left`` runs out (TimeoutExpired); ``sampled``: where
        py-spy writes the child's stacks (20 samples/s, every busy thread, without pausing it)."""
        proc = subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        spy = None
        if sampled is not None and self.py_spy is not None:
            cmd = [str(self.py_spy), "record", "--pid", str(proc.pid), "--nonblocking", "-r", "20", "-f", "raw"]
            try:  # instrumentation: a sampler that cannot start leaves the step unsampled, not failed
                spy = subprocess.Popen([*cmd, "-o", str(sampled)], stdout=self.log, stderr=subprocess.STDOUT)
            except OSError as e:
                print(f"py-spy not started ({e}): {sampled.name} not sampled", file=self.log, flush=True)
        try:
            return proc.wait(timeout=left)
        finally:
            if spy is not None and spy.poll() is None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT (or when the child ends)
                try:  # bounded: a sampler that will not stop neither changes the step's outcome nor keeps its child
                    spy.wait(timeout=RESERVE_S / 2)
                except subprocess.TimeoutExpired:
                    spy.kill()
                    spy.wait()
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def step(self, name: str, call) -> bool:
        """``call(seconds left)``; True if it returned 0 (a failure, timeout or spent budget is recorded)."""
        left = self.budget_s - (time.monotonic() - self.t0)
        entry: dict[str, Any] = {"step": name, "status": "running"}
        self.record["steps"].append(entry)
        if left <= 0:
            entry.update(status="skipped", reason="budget spent")
            return False
        start = time.monotonic()
        entry["started_at"] = round(time.time(), 2)  # unix seconds: the GPU samples of a step (call_report)
        self.save()
        print(f"=== {name} ({left:.0f} s left)", file=self.log, flush=True)
        try:
            rc = call(left)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        except (Exception, SystemExit) as e:  # recorded; the results so far are still packed
            traceback.print_exc(file=self.log)
            rc = f"{type(e).__name__}: {e}"
        entry.update(seconds=round(time.monotonic() - start, 2), status="ok" if rc == 0 else f"failed ({rc})")
        print(f"=== {name}: {entry['status']} in {entry['seconds']} s", file=self.log, flush=True)
        self.save()
        return rc == 0

    def skip(self, steps: list[tuple[str, list[str]]]) -> None:
        self.record["steps"] += [{"step": n, "status": "skipped", "reason": "an earlier step failed"} for n, _ in steps]

    def lane(self, steps: list[tuple[str, list[str]]], cwd: Path, env: dict[str, str]) -> bool:
        """Stage commands one after the other, each a child ``python``; after a failure the rest are skipped."""
        for i, (name, argv) in enumerate(steps):
            sampled = cwd.parent / f"pyspy-{name}.txt" if name.startswith("train") else None
            if not self.step(name, partial(self.child, argv, cwd, env, sampled=sampled)):
                self.skip(steps[i + 1 :])
                return False
        return True

    def stages(self, commands: list[tuple[str, list[str]]], cwd: Path, env: dict[str, str]) -> bool:
        """:func:`stage_commands` in :func:`stage_lanes`' order: the backbone's warm-up (GPU) beside the other data
        stages (CPU); each set's ``train@i`` then ``evaluate@i`` in a lane, the sets' lanes side by side (a resumed
        call's lane may hold only what is left of it); after a failure the rest are skipped."""
        before, lanes, after = stage_lanes(commands)
        in_sets = [s for s in after if s[0].startswith(("train@", "evaluate@"))]  # the experiments' sets
        sets: dict[str, list[tuple[str, list[str]]]] = {}
        for step in in_sets:
            sets.setdefault(step[0].split("@")[1], []).append(step)
        cut = after.index(in_sets[0]) if in_sets else len(after)
        ok = (
            self.lane(before, cwd, env)
            and self.side_by_side(lanes, cwd, env)
            and self.lane(after[:cut], cwd, env)
            and self.side_by_side(list(sets.values()), cwd, env)
            and self.lane(after[cut + len(in_sets) :], cwd, env)
        )
        if not ok:  # the steps never reached
            reached = {e["step"] for e in self.record["steps"]}
            self.skip([s for s in commands if s[0] not in reached])
        return ok

    def side_by_side(self, lanes: list[list[tuple[str, list[str]]]], cwd: Path, env: dict[str, str]) -> bool:
        """Each lane in a thread of its own; True if every one passed."""
        if not lanes:
            return True
        with ThreadPoolExecutor(len(lanes)) as pool:
            return all(list(pool.map(lambda lane: self.lane(lane, cwd, env), lanes)))


def code_hash(root: Path) -> str:
    """sha256 of the files (path and bytes) under ``root``'s :data:`CODE` folders, bytecode caches left out."""
    digest = hashlib.sha256()
    for path in sorted(p for top in CODE for p in (root / top).rglob("*") if "__pycache__" not in p.parts):
        if path.is_file():
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _leaves(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``params``' leaves by their dotted key (``train.rounds``)."""
    leaves: dict[str, Any] = {}
    for key, value in params.items():
        leaves |= _leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return leaves


def params_changed(repo: Path, profile: Path, repo_dir: Path) -> list[str]:
    """The params whose value in ``repo_dir``'s params.yaml (what the call that made the workspace merged) is not
    the one ``repo``'s params.yaml with ``profile`` merged gives now."""
    import yaml  # PyYAML: on the lent image (transformers needs it)

    sent = _leaves(merged_params(repo, profile))
    ran = _leaves(yaml.safe_load((repo_dir / "params.yaml").read_text()))
    return sorted(k for k in sent.keys() | ran.keys() if k not in sent or k not in ran or sent[k] != ran[k])


def refuse(out: Path, error: str) -> NoReturn:
    """A call that cannot go on: the one-line ``error`` in the study.json it returns, and its exit."""
    (out / "study.json").write_text(json.dumps({"complete": False, "error": error}) + "\n")
    raise SystemExit(error)


DETACHED = "detached"  # under --work: a detached study's pid, its output and its own --out


def detach(run_argv: list[str], work: Path, out: Path, wait_s: float) -> int:
    """Start ``run_argv`` (a ``run`` command's arguments without ``--detach`` and ``--out``) in a session of its own,
    writing its files to ``<work>/detached/out``, then :func:`collect` them for ``wait_s`` seconds."""
    home = work / DETACHED
    out.mkdir(parents=True, exist_ok=True)
    if (home / "daemon.json").is_file() and _running(pid := json.loads((home / "daemon.json").read_text())["pid"]):
        refuse(out, f"{home}: a detached study (pid {pid}) still runs: `wait` for it rather than start another")
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    cmd = [sys.executable, "-m", "tools.gpu_study.device", "run", *run_argv, "--out", str(home / "out")]
    with (home / "daemon.txt").open("w") as output:  # not the call's stdout: the tool would wait for it to close
        study = subprocess.Popen(
            cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    (home / "daemon.json").write_text(json.dumps({"pid": study.pid, "argv": cmd}) + "\n")
    return collect(work, out, wait_s, study)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has: its parent has not reaped it yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def collect(work: Path, out: Path, wait_s: float, study: subprocess.Popen | None = None) -> int:
    """Wait up to ``wait_s`` seconds for the detached study in ``work``, then put its files under ``out``: the ones
    it packed if it ended (0 if complete, else 1), or, while it runs on, a snapshot (3): study.json (its steps so
    far, ``detached`` saying it runs on), log.tar.gz and results.tar.gz as they stand."""
    home = work / DETACHED
    out.mkdir(parents=True, exist_ok=True)
    if not (home / "daemon.json").is_file():
        refuse(out, f"{work}: no detached study: a fresh machine (the study call's must still be warm)")
    pid = json.loads((home / "daemon.json").read_text())["pid"]
    running = (lambda: study.poll() is None) if study else partial(_running, pid)  # a child of this call, or not
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and running():
        time.sleep(1)
    if not running():
        for f in sorted((home / "out").glob("*")) + [home / "daemon.txt"]:
            shutil.copy(f, out / f.name)
            print(f"{f.name}: {f.stat().st_size / 2**20:.2f} MiB")
        if not (out / "study.json").is_file():
            refuse(out, f"{home / 'daemon.txt'}: the detached study ended without its study.json (see daemon.txt)")
        return 0 if json.loads((out / "study.json").read_text()).get("complete") else 1
    saved = work / "study.json"  # the study's record so far (none before its first step)
    record = json.loads(saved.read_text()) if saved.is_file() else {"steps": [], "complete": False}
    record["detached"] = f"pid {pid} runs on: `python3 -m tools.gpu_study.device wait` returns its files"
    (out / "study.json").write_text(json.dumps(record, indent=2) + "\n")
    pack_work(work, out)
    print(json.dumps({"detached": record["detached"], "steps": record["steps"]}, indent=1))
    return 3


def run_study(
    carry: Path,
    out: Path,
    profile: Path,
    work: Path,
    budget_s: float,
    stage_dir: Path = STAGE_DIR,
    repo: Path = REPO,
    resume: bool = False,
    py_spy: Path | None = None,
    train_processes: int = 1,
) -> dict:
    """Everything of the module docstring; returns study.json's content (also written under ``out``). ``resume``:
    a later call on the same machine goes on in ``work`` where the last one stopped: the steps it recorded ok are
    kept (its record under ``earlier_calls``), the others run again (``train`` resumes its runs from their round
    checkpoints), the log and GPU samples are appended to, and nothing is read from ``carry``."""
    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    site, repo_dir, minilm = work / "site", work / "repo", work / "minilm"
    log_path = work / "log.txt"
    if resume and not (work / "study.json").is_file():  # the machine went back: nothing to go on from, no carry
        refuse(
            out, f"{work}: no earlier call's study.json: a fresh machine (a resumed call needs the study call's, warm)"
        )
    earlier = json.loads((work / "study.json").read_text()) if resume else None
    work.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"profile": profile.name, "budget_s": budget_s, "device": device_info(), "steps": []}
    done: set[str] = set()
    if earlier:
        record["earlier_calls"] = earlier.pop("earlier_calls", []) + [earlier]
        done = {s["step"] for call in record["earlier_calls"] for s in call["steps"] if s["status"] == "ok"}
    # the stages run the workspace's copy of the code (made by the call that ran `workspace`), never this checkout's
    if {"install", "workspace"} <= done and code_hash(repo_dir) != code_hash(repo):
        refuse(
            out,
            f"{repo_dir}: its pipeline/ and tools/ are not the checkout's this call was sent with (changed since the "
            f"call that made it): resumed, the stages would run the old code; send a study call (no --resume)",
        )
    if {"install", "workspace"} <= done and (changed := params_changed(repo, profile, repo_dir)):
        refuse(
            out,
            f"{repo_dir / 'params.yaml'}: {', '.join(changed)} differ from the checkout's params.yaml with "
            f"{profile.name} merged: resumed, the stages would run the old params; send a study call (no --resume)",
        )
    smi = None
    with log_path.open("a" if earlier else "w") as log:
        if shutil.which("nvidia-smi"):
            smi = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=timestamp,utilization.gpu,memory.used", "--format=csv", "-l", "2"],
                stdout=(work / "gpu.csv").open("a" if earlier else "w"),
                stderr=subprocess.STDOUT,
            )

        steps = Steps(record, log, budget_s - RESERVE_S, t0, py_spy, (work / "study.json", out / "study.json"))
        params: dict[str, Any] = {}

        def workspace(left: float) -> int:
            assemble_minilm(carry, stage_dir, minilm)
            params.update(make_workspace(repo, repo_dir, carry, profile))
            return 0

        if {"install", "workspace"} <= done:
            import yaml  # PyYAML: on the lent image (transformers needs it)

            params.update(yaml.safe_load((repo_dir / "params.yaml").read_text()))
            ok = True
        else:
            ok = steps.step("install", lambda left: install_wheels(carry / "wheels", site, log))
            ok = ok and steps.step("workspace", workspace)
        commands = [c for c in stage_commands(params, train_processes) if c[0] not in done] if ok else []
        commands = [c for c in (left_to_do(c, repo_dir) for c in commands) if c is not None]
        ok = ok and steps.stages(commands, repo_dir, child_env(repo_dir, site, minilm))
        if smi is not None:
            smi.terminate()
            smi.wait()
    record["seconds"] = round(time.monotonic() - t0, 2)
    record["complete"] = ok
    (work / "study.json").write_text(json.dumps(record, indent=2) + "\n")
    files = [shutil.copy(work / "study.json", out / "study.json"), *pack_work(work, out)]
    if len(files) > MAX_FILES:
        raise SystemExit(f"{out}: {len(files)} files, more than the {MAX_FILES} the machine returns")
    for f in files:
        print(f"{Path(f).name}: {Path(f).stat().st_size / 2**20:.2f} MiB")
    print(json.dumps({k: record[k] for k in ("seconds", "complete")} | {"steps": record["steps"]}, indent=1))
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the whole study (the lent machine's one command)")
    run.add_argument("--carry", type=Path, default=Path(".gpu-study/carry"), help="the carried folder")
    run.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")), help="where the files go")
    run.add_argument("--profile", type=Path, default=PROFILE)
    run.add_argument("--work", type=Path, default=Path("/tmp/gpu-study"), help="scratch folder (replaced)")
    run.add_argument("--budget", type=float, default=540, help="seconds for everything, packing included")
    run.add_argument("--resume", action="store_true", help="go on where the last call in --work stopped")
    run.add_argument("--py-spy", type=Path, help="a py-spy executable: the train step's threads are sampled")
    run.add_argument("--train-processes", type=int, default=1, help="train the experiments in this many processes")
    run.add_argument("--detach", type=float, metavar="W", help="run on in a session of its own; return after W s")
    wait = sub.add_parser("wait", help="a later call: wait for the detached study, return its files")
    wait.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")), help="where the files go")
    wait.add_argument("--work", type=Path, default=Path("/tmp/gpu-study"), help="the study call's --work")
    wait.add_argument("--budget", type=float, default=540, help="seconds to wait, packing included")
    st = sub.add_parser("stage", help="a staging call: keep a carried folder's weight parts for the study's call")
    st.add_argument("folder", type=Path)
    ev = sub.add_parser("evaluate", help="the evaluate stage of several experiments in one process (step 5)")
    ev.add_argument("--experiment", action="append", required=True)
    args = ap.parse_args(argv)
    if args.command == "run" and args.train_processes < 1:  # a typo would end the lease's call in a ZeroDivisionError
        ap.error(f"--train-processes {args.train_processes}: give 1 or more")
    if args.command == "evaluate":
        evaluate_all(args.experiment)
        return 0
    if args.command == "stage":
        stage(args.folder)
        return 0
    if args.command == "wait":
        return collect(args.work, args.out.resolve(), args.budget - RESERVE_S)
    carry, out, profile = args.carry.resolve(), args.out.resolve(), args.profile.resolve()
    if args.detach is not None:
        run_argv = ["--carry", str(carry), "--profile", str(profile), "--work", str(args.work.resolve())]
        run_argv += ["--budget", str(args.budget), "--train-processes", str(args.train_processes)]
        run_argv += ["--resume"] * args.resume + (["--py-spy", str(args.py_spy.resolve())] if args.py_spy else [])
        return detach(run_argv, args.work.resolve(), out, args.detach)
    spy = args.py_spy.resolve() if args.py_spy else None
    if spy is not None and spy.is_file():  # a carried file's mode bits may not travel (benchmarks/gpu_profile.py)
        spy.chmod(0o755)
    record = run_study(
        carry,
        out,
        profile,
        args.work,
        args.budget,
        resume=args.resume,
        py_spy=spy,
        train_processes=args.train_processes,
    )
    return 0 if record["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
