"""Outputs written whole (issue 15, item 3): every stage output goes through pipeline/common/atomic.py, a stage
SIGKILLed in the middle of a write leaves the old output (never half of one), the next run succeeds and removes what the
killed run left behind, and DVC records only whole outputs.

The kill point is deterministic: ``FEDMEET_FAULT_KILL_WRITE=<name>[@n]`` makes the stage cut its temporary file to
half and SIGKILL itself inside its n-th atomic write of ``<name>`` (pipeline/common/atomic.py)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from reliability import FIXTURES, REPO_ROOT, run_subprocess, stage_env, write_params

from pipeline.common.atomic import ENV_KILL

# Writes in pipeline/ that do not go through pipeline.common.atomic (file, start of the line), each with why it is
# whole.
DIRECT_WRITE = re.compile(
    r"open\([^)]*[\"'](w|wb|a|ab|w\+)[\"']|(?<!atomic)\.(write_text|write_bytes|to_parquet|"
    r"to_csv|savefig|to_json|save_pretrained)\(|\bsave_file\(|torch\.save\(|np\.save\(|json\.dump\("
)
ALLOWED = {
    # built in atomic.temp_dir_for(...) and moved into place whole by atomic.replace_dir
    ("modeling/backbone.py", "model.save_pretrained(out_dir)"),
    ("modeling/backbone.py", "tokenizer.save_pretrained(out_dir)"),
    ("modeling/backbone.py", "(out_dir / RECORD_NAME).write_text("),
    # its own temporary + os.replace (it decides after writing whether the entry fits the size budget)
    ("modeling/cache.py", "save_file("),
    # write the temporary that atomic.replacing yields
    ("training/checkpoints.py", "torch.save({**checkpoint_identity(plan)"),
    # process logs of a local deployment, appended to while the processes run (not a stage output)
    ("federation/processes.py", 'with open(log, "ab") as out:'),
}


def test_every_write_in_the_pipeline_goes_through_atomic():
    found = set()
    for path in sorted((REPO_ROOT / "pipeline").rglob("*.py")):  # the subpackages too
        name = path.relative_to(REPO_ROOT / "pipeline").as_posix()
        if name == "common/atomic.py":
            continue
        for line in path.read_text().splitlines():
            if DIRECT_WRITE.search(line) and not line.lstrip().startswith("#"):
                found.add((name, line.strip()))
    allowed = {
        (name, line)
        for name, line in found
        if any(name == a_name and line.startswith(a_line) for a_name, a_line in ALLOWED)
    }
    assert found == allowed, f"direct writes outside pipeline/common/atomic.py: {sorted(found - allowed)}"
    assert len(allowed) == len(ALLOWED)  # every exception is still there (else the list is stale)


def test_the_scan_sees_a_direct_write():
    assert DIRECT_WRITE.search('    (out / "metrics.json").write_text(text)')
    assert DIRECT_WRITE.search("    frame.to_parquet(out)")
    assert DIRECT_WRITE.search('    with open(path, "w") as fh:')
    assert not DIRECT_WRITE.search("    atomic.write_text(out / 'x.json', text)")


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if ".tmp" in p.name)


@pytest.fixture
def samsum_stage(tmp_path) -> tuple[Path, list[str]]:
    """Stage `ingest --dataset samsum` over a copy of the SAMSum fixture, run in ``tmp_path``."""
    shutil.copytree(FIXTURES / "samsum", tmp_path / "data" / "samsum")
    write_params(tmp_path / "params.yaml", tmp_path / "data", datasets=["samsum"])
    return tmp_path, [
        "--dataset",
        "samsum",
        "--params",
        "params.yaml",
        "--interim-dir",
        "interim",
        "--report-dir",
        "reports",
    ]


def add_dialogue(root: Path) -> None:
    path = root / "data" / "samsum" / "train.json"
    rec = {"id": "99", "dialogue": "Ann: bye\nBob: bye", "summary": "They part."}
    path.write_text(path.read_text() + json.dumps(rec) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["samsum.parquet", "ingest_samsum.json"])
def test_stage_killed_mid_write_leaves_old_output_and_the_rerun_succeeds(samsum_stage, kill_at):
    cwd, args = samsum_stage
    parquet, report = cwd / "interim" / "samsum.parquet", cwd / "reports" / "ingest_samsum.json"
    assert run_subprocess("pipeline.ingest", args, cwd).status == 0
    old_rows, old_bytes, old_report = len(pd.read_parquet(parquet)), parquet.read_bytes(), report.read_text()

    add_dialogue(cwd)
    killed = run_subprocess("pipeline.ingest", args, cwd, **{ENV_KILL: kill_at})
    assert killed.status == -signal.SIGKILL
    # The file being written is the old one, whole; the killed run's half-written temporary sits beside it.
    if kill_at == "samsum.parquet":
        assert parquet.read_bytes() == old_bytes
        assert report.read_text() == old_report
    else:  # killed on the second output: the first is already new and whole, the second still old and whole
        assert len(pd.read_parquet(parquet)) == old_rows + 1
        assert report.read_text() == old_report
    assert len(leftovers(cwd / "interim") + leftovers(cwd / "reports")) == 1

    rerun = run_subprocess("pipeline.ingest", args, cwd)
    assert rerun.status == 0, rerun.stderr
    assert len(pd.read_parquet(parquet)) == old_rows + 1
    assert json.loads(report.read_text())["n_records"] == old_rows + 1
    assert leftovers(cwd / "interim") + leftovers(cwd / "reports") == []


def test_directory_output_killed_before_its_rename(tmp_path):
    """atomic.replace_dir (the backbone directory): a kill leaves the old directory whole; the next replacement
    removes the killed run's half-built directory."""
    script = (
        "import sys; from pathlib import Path; from pipeline.common import atomic\n"
        "out = Path(sys.argv[1]); tmp = atomic.temp_dir_for(out)\n"
        "(tmp / 'weights.bin').write_bytes(sys.argv[2].encode() * 1000)\n"
        "atomic.replace_dir(tmp, out)\n"
    )
    out = tmp_path / "backbone"

    def run(content: str, **env: str) -> int:
        return subprocess.run(
            [sys.executable, "-c", script, str(out), content], env=stage_env(**env), cwd=tmp_path, timeout=60
        ).returncode

    assert run("a") == 0
    assert run("b", **{ENV_KILL: "backbone"}) == -signal.SIGKILL
    assert (out / "weights.bin").read_bytes() == b"a" * 1000
    assert len(leftovers(tmp_path)) == 1
    assert run("c") == 0
    assert (out / "weights.bin").read_bytes() == b"c" * 1000
    assert leftovers(tmp_path) == []


def test_a_live_writers_temporary_is_left_alone(tmp_path):
    """Stale temporaries are removed only when the process that made them is gone (a concurrent writer's stays)."""
    from pipeline.common import atomic

    target = tmp_path / "x.json"
    live = tmp_path / f".x.{1}.deadbeef.tmp.json"  # pid 1 (init) is always alive
    dead = tmp_path / f".x.{2**22 + 7}.deadbeef.tmp.json"  # above the kernel's pid limit: never a live process
    other = tmp_path / f".x.y.{2**22 + 7}.deadbeef.tmp.json"  # the temporary of another output, x.y.json
    for p in (live, dead, other):
        p.write_text("half")
    atomic.write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name, other.name])


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_dvc_never_records_a_half_written_output(samsum_stage):
    """`dvc repro` of a stage killed in mid-write fails and records nothing; the next `dvc repro` records the
    whole output (its hash in dvc.lock is that of the complete file)."""
    cwd, args = samsum_stage
    dvc = Path(sys.executable).with_name("dvc")
    stage = {
        "cmd": f"{sys.executable} -m pipeline.ingest " + " ".join(args),
        "deps": ["data/samsum"],
        "outs": ["interim/samsum.parquet"],
    }
    (cwd / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"ingest": stage}}))
    env = stage_env()  # DVC_NO_ANALYTICS from tests/conftest.py

    def repro(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(dvc), "repro", "-q"], cwd=cwd, env={**env, **extra}, capture_output=True, text=True, timeout=180
        )

    subprocess.run([str(dvc), "init", "--no-scm", "-q"], cwd=cwd, env=env, check=True, timeout=60)
    killed = repro(**{ENV_KILL: "samsum.parquet"})
    assert killed.returncode != 0
    assert not (cwd / "dvc.lock").exists()
    assert not (cwd / "interim" / "samsum.parquet").exists()

    done = repro()
    assert done.returncode == 0, done.stderr
    lock = yaml.safe_load((cwd / "dvc.lock").read_text())
    out = lock["stages"]["ingest"]["outs"][0]
    parquet = cwd / "interim" / "samsum.parquet"
    assert out["md5"] == md5(parquet) and out["size"] == parquet.stat().st_size
    # the fixture: train's three dialogues less the empty one, one each in validation and test
    assert len(pd.read_parquet(parquet)) == 4
    assert leftovers(cwd / "interim") == []
