"""The Python steps of the GPU lease (tools/gpu_lease/run.sh) and the import of its results here.

    python tools/gpu_lease/lease.py merge PROFILE params.yaml     # on the device, in the scratch repository
    python tools/gpu_lease/lease.py collect LEASE_DIR OUT         # on the device: the results into OUT (<= 8 files)
    python tools/gpu_lease/lease.py import FOLDER [--root .]      # here: the returned files into the checkout

``merge`` is the profile's merge into params.yaml that ``python -m pipeline.presets`` performs (a mapping merged key
by key, a leaf or list replaced, ``experiments`` replaced whole), kept here so that the lease depends on no CLI of the
package. ``collect`` packs, as tar.gz files cut at 15 MiB, what the run wrote: dvc.lock, params.yaml and reports/
of the study (train, eval with per-example scores, timing, backbone, analysis and tables), models/ without weights
(plans, gate logs, run records) and data/processed, data/partitions (what analyze and report read), the MLflow
store (mlflow.db, and mlartifacts/ without adapters), and the lease's own logs (dvc repro output stamped per line, nvidia-smi samples, per-stage wall times). ``import``
unpacks them into the checkout, points the MLflow store's artifact locations at it, and puts the logs into
reports/gpu-lease/.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import sqlite3
import tarfile
import tempfile
from pathlib import Path

PIECE = 15 * 1024 * 1024  # files back from the device: 16 MiB each at most
MAX_FILES = 8
REPLACED_WHOLE = ("experiments",)


# --------------------------------------------------------------------------------------------- merge
def merge(dst: dict, src: dict, top: bool = True) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict) and not (top and key in REPLACED_WHOLE):
            merge(dst[key], value, top=False)
        else:
            dst[key] = value


def cmd_merge(profile: Path, params: Path) -> None:
    import yaml
    from ruamel.yaml import YAML  # DVC's own YAML library: params.yaml keeps its comments

    rt = YAML()
    rt.width = 4096
    doc = rt.load(params.read_text())
    prof = yaml.safe_load(profile.read_text())
    if not isinstance(prof, dict):
        raise SystemExit(f"{profile}: not a mapping of params groups")
    merge(doc, prof)
    buf = io.StringIO()
    rt.dump(doc, buf)
    params.write_text(buf.getvalue())
    print(f"{profile} merged into {params} ({len(prof.get('experiments') or {})} experiments)")


# --------------------------------------------------------------------------------------------- collect
def stage_times(log: Path, ended: int | None) -> list[tuple[str, int]]:
    """(stage, seconds) from dvc repro's output stamped with epoch seconds: a stage runs until the next one starts."""
    starts = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"(\d+) Running stage '([^']+)'", line)
        if m:
            starts.append((int(m.group(1)), m.group(2)))
    out = []
    for i, (t, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else ended
        if end is not None:
            out.append((name, end - t))
    return out


def _add_tree(tar: tarfile.TarFile, root: Path, rel: str, skip, since: float = 0.0) -> None:
    """Files under ``root/rel`` written since ``since`` (epoch s) that ``skip`` keeps: the run's outputs, not the
    reports the working tree already had (reports/cpu-study and the like travel there and back for nothing)."""
    base = root / rel
    if not base.exists():
        return
    paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
    for p in paths:
        name = p.relative_to(root).as_posix()
        if not skip(name) and p.stat().st_mtime >= since:
            tar.add(p, arcname=name)


def _pack(name: str, out: Path, fill) -> list[Path]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        fill(tar)
    data = buf.getvalue()
    if len(data) <= PIECE:
        (out / name).write_bytes(data)
        return [out / name]
    files = []
    for i in range(0, len(data), PIECE):
        f = out / f"{name}.part{i // PIECE + 1}"
        f.write_bytes(data[i : i + PIECE])
        files.append(f)
    return files


def cmd_collect(lease: Path, out: Path) -> None:
    study = lease / "study"
    out.mkdir(parents=True, exist_ok=True)
    ended = int((lease / "ended").read_text()) if (lease / "ended").is_file() else None
    times = stage_times(lease / "repro.log", ended) if (lease / "repro.log").is_file() else []
    info = {
        "study_root": str(study.resolve()),
        "profile": "profile.yaml",
        "started": int((lease / "started").read_text()) if (lease / "started").is_file() else None,
        "ended": ended,
        "dvc_repro_exit": int((lease / "repro.rc").read_text()) if (lease / "repro.rc").is_file() else None,
    }

    since = (info["started"] or 0) - 1

    def reports(tar):
        for rel in ("dvc.lock", "params.yaml"):
            _add_tree(tar, study, rel, lambda n: False)
        _add_tree(tar, study, "reports", lambda n: False, since)

    def models(tar):  # no weights: neither the backbone's nor the adapters
        _add_tree(tar, study, "models", lambda n: n.endswith((".safetensors", ".bin", ".pt")), since)
        # what analyze and report read besides reports/: the model inputs, the POS tags (they need the backbone's
        # tokenizer, which stays there) and the partitions
        for rel in ("data/processed", "data/partitions"):
            _add_tree(tar, study, rel, lambda n: False, since)

    def mlflow(tar):
        _add_tree(tar, study, "mlflow.db", lambda n: False)
        _add_tree(tar, study, "mlartifacts", lambda n: "/adapters/" in n)

    def logs(tar):
        for f in ("repro.log", "gpu.csv", "profile.yaml"):
            if (lease / f).is_file():
                tar.add(lease / f, arcname=f"gpu-lease/{f}")
        for name, blob in (
            ("stage_times.tsv", "stage\tseconds\n" + "".join(f"{s}\t{t}\n" for s, t in times)),
            ("lease.json", json.dumps(info, indent=2) + "\n"),
        ):
            ti = tarfile.TarInfo(f"gpu-lease/{name}")
            ti.size = len(blob.encode())
            tar.addfile(ti, io.BytesIO(blob.encode()))

    files = []
    for name, fill in (
        ("lease.tar.gz", logs),
        ("reports.tar.gz", reports),
        ("models-data.tar.gz", models),
        ("mlflow.tar.gz", mlflow),
    ):
        files += _pack(name, out, fill)
    total = sum(f.stat().st_size for f in files)
    for f in files:
        print(f"{f.name}: {f.stat().st_size / 2**20:.2f} MiB")
    if len(files) > MAX_FILES or total > 64 * 2**20:
        raise SystemExit(
            f"collect: {len(files)} files, {total / 2**20:.1f} MiB: more than the device returns "
            f"({MAX_FILES} files, 64 MiB)"
        )
    print(f"collected {len(files)} files, {total / 2**20:.1f} MiB, into {out}")


# --------------------------------------------------------------------------------------------- import
def _archives(folder: Path) -> dict[str, bytes]:
    """name -> bytes of each returned archive, pieces joined in order."""
    out: dict[str, list[tuple[int, Path]]] = {}
    for f in folder.iterdir():
        m = re.fullmatch(r"(.+\.tar\.gz)(?:\.part(\d+))?", f.name)
        if m:
            out.setdefault(m.group(1), []).append((int(m.group(2) or 0), f))
    return {name: b"".join(p.read_bytes() for _, p in sorted(parts)) for name, parts in out.items()}


def cmd_import(folder: Path, root: Path, mlflow_db: Path | None) -> None:
    archives = _archives(folder)
    for need in ("lease.tar.gz", "reports.tar.gz"):
        if need not in archives:
            raise SystemExit(f"{folder}: {need} missing (the files of `run.sh collect`)")
    info = {}
    with tarfile.open(fileobj=io.BytesIO(archives["lease.tar.gz"])) as tar:
        tar.extractall(root / "reports", filter="data")
        info = json.loads((root / "reports/gpu-lease/lease.json").read_text())
    for name in ("reports.tar.gz", "models-data.tar.gz"):
        if name in archives:
            with tarfile.open(fileobj=io.BytesIO(archives[name])) as tar:
                tar.extractall(root, filter="data")
    if "mlflow.tar.gz" in archives:
        db = (mlflow_db or root / "mlflow.db").resolve()
        if db.exists():
            raise SystemExit(f"{db}: an MLflow store is already there; name another with --mlflow-db")
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            with tarfile.open(fileobj=io.BytesIO(archives["mlflow.tar.gz"])) as tar:
                tar.extractall(tmp, filter="data")
            shutil.move(Path(tmp) / "mlflow.db", db)
            if (Path(tmp) / "mlartifacts").is_dir():
                shutil.copytree(Path(tmp) / "mlartifacts", root / "mlartifacts", dirs_exist_ok=True)
        # MLflow stores absolute file: locations; point the lease machine's (mlartifacts/, mlruns/ of the Default
        # experiment) at this checkout; as file: URIs and as plain paths (the Default experiment's)
        study_root = Path(info["study_root"])
        with sqlite3.connect(db) as con:
            for old, new in ((study_root.as_uri(), root.resolve().as_uri()), (f"{study_root}/", f"{root.resolve()}/")):
                con.execute(
                    "UPDATE experiments SET artifact_location = replace(artifact_location, ?, ?) "
                    "WHERE artifact_location LIKE ?",
                    (old, new, old + "%"),
                )
                con.execute(
                    "UPDATE runs SET artifact_uri = replace(artifact_uri, ?, ?) WHERE artifact_uri LIKE ?",
                    (old, new, old + "%"),
                )
        print(f"MLflow store: {db} (mlflow ui --backend-store-uri sqlite:///{db})")
    print(
        f"imported {folder} into {root}: dvc repro exit status {info.get('dvc_repro_exit')}, "
        f"{(info.get('ended') or 0) - (info.get('started') or 0)} s; logs in {root / 'reports/gpu-lease'}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge")
    m.add_argument("profile", type=Path)
    m.add_argument("params", type=Path)
    c = sub.add_parser("collect")
    c.add_argument("lease", type=Path)
    c.add_argument("out", type=Path)
    i = sub.add_parser("import")
    i.add_argument("folder", type=Path)
    i.add_argument("--root", type=Path, default=Path("."))
    i.add_argument("--mlflow-db", type=Path, help="where the returned MLflow store goes (default ROOT/mlflow.db)")
    args = ap.parse_args(argv)
    if args.cmd == "merge":
        cmd_merge(args.profile, args.params)
    elif args.cmd == "collect":
        cmd_collect(args.lease, args.out)
    else:
        cmd_import(args.folder, args.root.resolve(), args.mlflow_db)


if __name__ == "__main__":
    main()
