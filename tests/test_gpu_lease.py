"""tools/gpu_lease/lease.py: the profile merge, per-stage wall times, and collect -> import of a finished lease."""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_lease", ROOT / "tools/gpu_lease/lease.py")
lease = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lease)


def test_merge_replaces_experiments_whole_and_merges_other_groups(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(
        "train:\n  rounds: 3  # kept comment\n  lr: 0.1\nexperiments:\n  a: {method: single}\n  b: {method: fedavg}\n"
    )
    profile = tmp_path / "p.yaml"
    profile.write_text("train:\n  rounds: 40\nexperiments:\n  c: {method: fedkd}\n")
    lease.cmd_merge(profile, params)
    import yaml

    out = yaml.safe_load(params.read_text())
    assert out == {"train": {"rounds": 40, "lr": 0.1}, "experiments": {"c": {"method": "fedkd"}}}
    assert "# kept comment" in params.read_text()


def test_stage_times_run_until_the_next_stage_starts(tmp_path):
    log = tmp_path / "repro.log"
    log.write_text(
        "100 Verifying outputs\n105 Running stage 'ingest@qmsum':\n109 > python -m x\n"
        "112 Running stage 'train@a':\n150 done\n"
    )
    assert lease.stage_times(log, ended=160) == [("ingest@qmsum", 7), ("train@a", 48)]
    assert lease.stage_times(log, ended=None) == [("ingest@qmsum", 7)]


def _finished_lease(tmp_path: Path) -> Path:
    d = tmp_path / "lease"
    study = d / "study"
    old = study / "reports/old.md"
    old.parent.mkdir(parents=True)
    old.write_text("in the working tree before the run\n")
    os.utime(old, (1000, 1000))
    (d / "started").write_text("2000\n")
    (d / "ended").write_text("2300\n")
    (d / "repro.rc").write_text("0\n")
    (d / "repro.log").write_text("2000 Running stage 'backbone':\n2100 Running stage 'train@a':\n")
    (d / "gpu.csv").write_text("timestamp, utilization.gpu [%], memory.used [MiB]\nt, 87 %, 1000 MiB\n")
    for rel, text in {
        "dvc.lock": "schema: '2.0'\n",
        "params.yaml": "experiments: {a: {}}\n",
        "reports/eval/a/metrics.json": "{}\n",
        "models/a/gate_log.parquet": "g",
        "models/a/clients/c1/adapter_best.safetensors": "w",
        "models/backbone/model.safetensors": "w",
        "data/processed/postags.parquet": "p",
        "mlartifacts/main/r1/artifacts/metrics.json": "{}",
        "mlartifacts/main/r1/artifacts/adapters/c1/adapter_best.safetensors": "w",
    }.items():
        (study / rel).parent.mkdir(parents=True, exist_ok=True)
        (study / rel).write_text(text)
    uri = (study / "mlartifacts/main").as_uri()
    with sqlite3.connect(study / "mlflow.db") as con:
        con.execute("CREATE TABLE experiments (artifact_location TEXT)")
        con.execute("CREATE TABLE runs (artifact_uri TEXT)")
        con.execute("INSERT INTO experiments VALUES (?)", (uri,))
        con.execute("INSERT INTO runs VALUES (?)", (uri + "/r1/artifacts",))
    return d


def test_collect_then_import_brings_the_run_outputs_without_weights(tmp_path, monkeypatch):
    d = _finished_lease(tmp_path)
    monkeypatch.setattr(lease, "PIECE", 200)  # force the cutting into pieces
    monkeypatch.setattr(lease, "MAX_FILES", 32)
    out = tmp_path / "out"
    lease.cmd_collect(d, out)
    assert any(".part2" in f.name for f in out.iterdir())  # cut into pieces, joined again by import
    root = tmp_path / "checkout"
    root.mkdir()
    lease.cmd_import(out, root, None)
    assert (root / "reports/eval/a/metrics.json").read_text() == "{}\n"
    assert (root / "models/a/gate_log.parquet").read_text() == "g"
    assert (root / "data/processed/postags.parquet").read_text() == "p"
    assert (root / "dvc.lock").is_file() and (root / "params.yaml").is_file()
    assert not (root / "reports/old.md").exists()  # not written by the run
    assert not list(root.rglob("*.safetensors"))  # neither backbone nor adapters
    assert (root / "mlartifacts/main/r1/artifacts/metrics.json").is_file()
    assert (root / "reports/gpu-lease/stage_times.tsv").read_text() == "stage\tseconds\nbackbone\t100\ntrain@a\t200\n"
    assert json.loads((root / "reports/gpu-lease/lease.json").read_text())["dvc_repro_exit"] == 0
    with sqlite3.connect(root / "mlflow.db") as con:
        (loc,), (art,) = (
            con.execute("SELECT artifact_location FROM experiments"),
            con.execute("SELECT artifact_uri FROM runs"),
        )
    assert loc[0] == (root / "mlartifacts/main").as_uri()
    assert art[0] == (root / "mlartifacts/main/r1/artifacts").as_uri()


def test_import_refuses_to_overwrite_an_mlflow_store(tmp_path):
    d = _finished_lease(tmp_path)
    out = tmp_path / "out"
    lease.cmd_collect(d, out)
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "mlflow.db").write_text("mine")
    with pytest.raises(SystemExit, match="mlflow.db"):
        lease.cmd_import(out, root, None)
    assert (root / "mlflow.db").read_text() == "mine"
    lease.cmd_import(out, root, root / "gpu-study.db")
    assert (root / "mlflow.db").read_text() == "mine" and (root / "gpu-study.db").stat().st_size > 0
