"""tools/gpu_study: the study in one device call (device.py), its carry (prepare.py) and the import (importer.py).

The end-to-end test runs the device script on this CPU with the tiny profile, in two calls as on the lent machine (a
staging call of the first weight parts, then the study), then imports what it returned into a scratch study folder
and MLflow store."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from pipeline.presets import apply_preset
from tools.gpu_study import call_report, device, importer, prepare

pytestmark = pytest.mark.tools
ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/fixtures/mirror"
TINY = ROOT / "tools/gpu_study/tiny-profile.yaml"


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("profile", [ROOT / "configs/gpu-study.yaml", TINY], ids=["gpu-study", "tiny"])
def test_profile_merge_is_what_dvc_exp_run_set_param_makes(profile):
    params = _yaml(ROOT / "params.yaml")
    expected = apply_preset(params, _yaml(profile))  # DVC's own override parser (pipeline.presets)
    assert device.merge_profile(_yaml(ROOT / "params.yaml"), _yaml(profile)) == expected


def test_steps_are_dvc_yaml_commands_in_dependency_order():
    params = device.merge_profile(_yaml(ROOT / "params.yaml"), _yaml(ROOT / "configs/gpu-study.yaml"))
    stages = _yaml(ROOT / "dvc.yaml")["stages"]
    steps = dict(device.stage_commands(params))
    assert list(steps) == [
        *(f"ingest@{d}" for d in ("qmsum", "samsum", "ami", "icsi")),
        "examples",
        "partition@domain-0",
        "backbone",
        "plan",
        "train",
        "evaluate",
    ]
    commands = {name: "python " + " ".join(argv) for name, argv in steps.items()}
    assert commands["ingest@ami"] == stages["ingest"]["do"]["cmd"].replace("${item}", "ami")
    assert commands["partition@domain-0"] == stages["partition"]["cmd"].replace("${item.scheme}", "domain").replace(
        "${item.seed}", "0"
    )
    for name in ("examples", "backbone", "plan"):
        assert commands[name] == stages[name]["cmd"]
    # train: dvc.yaml's one-experiment command with every experiment of the profile (6 arms x 5 seeds), and no MLflow
    # there (the import logs the runs)
    assert stages["train"]["do"]["cmd"] == "python -m pipeline.train --experiment ${key}"
    assert len(params["experiments"]) == 30
    assert commands["train"] == (
        "python -m pipeline.train " + " ".join(f"--experiment {e}" for e in params["experiments"]) + " --no-mlflow"
    )


def _tiny_minilm(path: Path) -> Path:
    """A MiniLM-shaped folder at a test's size: a tiny BERT built from a config, the real MiniLM tokenizer files."""
    from transformers import BertConfig, BertModel

    from tests.tiny_models import _minilm_dir

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    BertModel(cfg).save_pretrained(path)
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(_minilm_dir() / f, path / f)
    return path


def test_weights_pack_losslessly_and_a_changed_byte_is_refused(tmp_path):
    blob = (_tiny_minilm(tmp_path / "m") / "model.safetensors").read_bytes()
    packed, info = device.pack_weights(blob)
    assert len(packed) < len(blob)  # the exponent plane compresses
    assert device.unpack_weights(packed, info) == blob
    bad = bytearray(packed)
    bad[info["head_bytes"] + 5] ^= 1  # a mantissa byte
    with pytest.raises(SystemExit, match="sha256"):
        device.unpack_weights(bytes(bad), info)


def test_carry_split_over_staging_calls_reassembles_the_weights(tmp_path):
    minilm = _tiny_minilm(tmp_path / "minilm")
    size = (minilm / "model.safetensors").stat().st_size
    carry_small = 2**20  # raw data and small files ~0.8 MiB: the packed weights need earlier calls
    m = prepare.build_carry(tmp_path / "lease", FIXTURES, ["qmsum", "samsum"], [], minilm, room=carry_small)
    stages = [c for c in m["calls"] if c != "carry"]
    assert len(stages) >= 2 and stages == [f"stage{i}" for i in range(1, len(stages) + 1)]
    assert all(v <= carry_small for v in m["calls"].values())
    assert m["weights"]["parts"] == [f"weights.part{i}" for i in range(1, len(stages) + 2)]
    # the lease's calls prepare prints: a staging call per folder, in order, then the study's (detached) and the call
    # that waits for its files
    calls = prepare.lease_calls(m)
    assert len(calls) == len(stages) + 2
    assert [c.rsplit(" ", 1)[-1] for c in calls[: len(stages)]] == [f".gpu-study/{n}" for n in stages]
    assert calls[0].startswith("kind nvidia-h200, carry ") and not any("kind" in c for c in calls[1:])
    assert calls[-2].startswith('carry [".gpu-study/carry"], limit ') and "--carry .gpu-study/carry" in calls[-2]
    assert "--detach W --train-processes 3" in calls[-2] and "device wait " in calls[-1]
    # the study's budget and the waiting call's end inside what the lease has left (the tool cuts a call there,
    # before its files are packed), the study's before the waiting call's deadline
    study_margin = int(calls[-2].split("B = budget_left_s - ")[1].split(",")[0])
    wait_margin = int(calls[-1].split("budget_left_s - ")[1].split(")")[0])
    assert "--budget B " in calls[-2] and calls[-1].endswith("--budget W") and study_margin > wait_margin > 0
    staged = tmp_path / "staged"
    with pytest.raises(SystemExit, match="staging call"):
        device.assemble_minilm(tmp_path / "lease/carry", staged, tmp_path / "out")
    for folder in stages:
        device.stage(tmp_path / "lease" / folder, stage_dir=staged)
    out = device.assemble_minilm(tmp_path / "lease/carry", staged, tmp_path / "out")
    assert (out / "model.safetensors").read_bytes() == (minilm / "model.safetensors").read_bytes()
    assert (out / "model.safetensors").stat().st_size == size
    assert (out / "vocab.txt").read_bytes() == (minilm / "vocab.txt").read_bytes()


def test_train_processes_take_whole_arms_dealt_in_turn():
    params = device.merge_profile(_yaml(ROOT / "params.yaml"), _yaml(ROOT / "configs/gpu-study.yaml"))
    experiments = list(params["experiments"])
    sets = device.train_sets(experiments, 3)
    arms = [sorted({e.rsplit("-s", 1)[0] for e in s}) for s in sets]
    assert arms == [
        ["fedkd-domain", "single-domain"],
        ["centralized-domain", "fedselectkd-domain"],
        ["fedavg-domain", "fedselectkd-quantile"],
    ]
    assert sorted(e for s in sets for e in s) == sorted(experiments) and [len(s) for s in sets] == [10, 10, 10]
    steps = dict(device.stage_commands(params, train_processes=3))
    assert [n for n in steps if n.startswith("train")] == ["train@1", "train@2", "train@3"]
    assert steps["train@2"] == [
        "-m",
        "pipeline.train",
        *(a for e in sets[1] for a in ("--experiment", e)),
        "--no-mlflow",
    ]
    # each set is evaluated right after it trained, the same experiments
    assert [n for n in steps if "@" in n and n.split("@")[0] in ("train", "evaluate")] == [
        f"{stage}@{i}" for i in (1, 2, 3) for stage in ("train", "evaluate")
    ]
    assert steps["evaluate@2"] == ["-m", "tools.gpu_study.device", "evaluate", *steps["train@2"][2:-1]]
    assert device.train_sets(experiments[:5], 3) == [experiments[:5]]  # one arm: one process


def test_the_backbone_warms_up_beside_the_data_stages_once_its_one_input_is_ingested():
    params = device.merge_profile(_yaml(ROOT / "params.yaml"), _yaml(ROOT / "configs/gpu-study.yaml"))
    commands = device.stage_commands(params)
    before, lanes, after = device.stage_lanes(commands)
    names = lambda steps: [name for name, _ in steps]  # noqa: E731
    assert names(before) == ["ingest@samsum"] and names(after) == ["plan", "train", "evaluate"]
    assert [names(lane) for lane in lanes] == [
        ["backbone"],
        ["ingest@qmsum", "ingest@ami", "ingest@icsi", "examples", "partition@domain-0"],
    ]
    assert sorted(names(before + [s for lane in lanes for s in lane] + after)) == sorted(names(commands))
    stages = _yaml(ROOT / "dvc.yaml")["stages"]
    outs = [o if isinstance(o, str) else next(iter(o)) for o in stages["ingest"]["do"]["outs"]]
    warmup = params["backbone"]["warmup"]["dataset"]  # the dep names it: data/interim/${backbone.warmup.dataset}
    data = {d.replace("${backbone.warmup.dataset}", warmup) for d in stages["backbone"]["deps"]}
    data = {d for d in data if not d.startswith("pipeline/")}  # the rest: its code
    assert device.BACKBONE_INPUT == f"ingest@{warmup}"
    assert data and data <= {o.replace("${item}", "samsum") for o in outs}


def test_a_spent_budget_skips_the_rest_and_still_returns_the_record(tmp_path):
    m = prepare.build_carry(
        tmp_path / "lease", FIXTURES, ["qmsum", "samsum"], [], _tiny_minilm(tmp_path / "m"), room=64 * 2**20
    )
    assert set(m["calls"]) == {"carry"}
    rec = device.run_study(tmp_path / "lease/carry", tmp_path / "out", TINY, tmp_path / "work", budget_s=0)
    assert not rec["complete"] and [s["status"] for s in rec["steps"]] == ["skipped"]
    assert json.loads((tmp_path / "out/study.json").read_text())["complete"] is False


FAKE_PY_SPY = """import os, signal, sys, time
args = sys.argv[1:]
pid, out, why = int(args[args.index("--pid") + 1]), args[args.index("-o") + 1], []
signal.signal(signal.SIGINT, lambda *_: why.append("SIGINT"))
while not why:
    time.sleep(0.02)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        why.append("exit")
open(out, "w").write(f"<module> (sampled {pid} until {why[0]}) 1\\n")
"""


@pytest.mark.parametrize("seconds, limit", [(0.3, 30), (30, 1.0)], ids=["ends", "cut"])
def test_the_train_step_is_sampled_until_it_ends_or_is_cut(tmp_path, seconds, limit):
    """With a py-spy executable (here a stand-in that records how it was stopped), the train step's child is sampled
    by its pid; its file is written when the step ends and when the budget kills it (py-spy writes on SIGINT)."""
    spy = tmp_path / "py-spy"
    spy.write_text(f"#!{sys.executable}\n{FAKE_PY_SPY}")
    spy.chmod(0o755)
    (tmp_path / "repo").mkdir()
    with (tmp_path / "log.txt").open("w") as log:
        steps = device.Steps({"steps": []}, log, budget_s=limit, t0=time.monotonic(), py_spy=spy)
        ok = steps.lane([("train", ["-c", f"import time; time.sleep({seconds})"])], tmp_path / "repo", dict(os.environ))
    assert ok is (seconds < limit)
    assert steps.record["steps"][0]["status"] == ("ok" if ok else "failed (timeout)")
    sampled = (tmp_path / "pyspy-train.txt").read_text()
    assert sampled.startswith("<module> (sampled ")
    stopped = sampled.split()[-2].rstrip(")")  # a cut step's child was still running: py-spy got SIGINT
    assert stopped in (("SIGINT", "exit") if ok else ("SIGINT",))


@pytest.mark.parametrize("resumed", [False, True], ids=["first-call", "resumed-call"])
def test_each_set_trains_then_evaluates_in_its_own_lane_beside_the_others(tmp_path, resumed):
    def sleeping(seconds):
        return ["-c", f"import time; time.sleep({seconds})"]

    commands = [("plan", sleeping(0))]
    commands += [
        (f"{stage}@{i}", sleeping(1.0 if stage == "train" else 0)) for i in (1, 2) for stage in ("train", "evaluate")
    ]
    if not resumed:  # a first call's data stages and backbone come before (a resumed call has them done)
        commands = [("ingest@samsum", sleeping(0)), ("backbone", sleeping(0))] + commands
    record: dict = {"steps": []}
    with (tmp_path / "log.txt").open("w") as log:
        assert device.Steps(record, log, 60, time.monotonic()).stages(commands, tmp_path, dict(os.environ))
    start = {s["step"]: s["started_at"] for s in record["steps"]}
    assert sorted(start) == sorted(name for name, _ in commands)
    assert abs(start["train@1"] - start["train@2"]) < 0.5  # the sets side by side
    assert start["evaluate@1"] - start["train@1"] >= 1.0 and start["evaluate@2"] - start["train@2"] >= 1.0


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~3 min on 2 loaded cores: every stage in its own process, then the import
def test_tiny_study_end_to_end_on_cpu_then_import(tmp_path, monkeypatch):
    # the stages run as on the lent machine, where neither MLflow nor DVC is installed: importing either fails there
    for absent in ("mlflow", "dvc"):
        (tmp_path / "absent" / absent).mkdir(parents=True)
        (tmp_path / "absent" / absent / "__init__.py").write_text(
            f"raise ImportError('{absent}: not on the machine')\n"
        )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "absent"))
    minilm = _tiny_minilm(tmp_path / "minilm")
    prepare.build_carry(tmp_path / "lease", FIXTURES, ["qmsum", "samsum"], [], minilm, room=2 * 2**20)
    staged, out = tmp_path / "staged", tmp_path / "out"
    for folder in sorted((tmp_path / "lease").glob("stage*")):  # the staging calls
        device.stage(folder, stage_dir=staged)
    rec = device.run_study(
        tmp_path / "lease/carry", out, TINY, tmp_path / "work", budget_s=900, stage_dir=staged, train_processes=2
    )
    assert rec["complete"], rec["steps"]
    assert [s["step"] for s in rec["steps"] if s["step"].startswith("train")] == ["train@1", "train@2"]
    assert len(list(out.iterdir())) <= device.MAX_FILES
    with tarfile.open(out / "results.tar.gz") as tar:
        names = tar.getnames()
    assert not [n for n in names if n.endswith(device.WEIGHTS)]  # the weights stay there; their md5 travel
    md5 = json.loads(tar_member(out / "results.tar.gz", "weights.md5.json"))
    assert "models/backbone/model.safetensors" in md5 and any("/clients/" in k for k in md5)

    # a later call on the same machine goes on where a cut one stopped: its train steps timed out with one run
    # unfinished, no evaluation ran. It trains that run alone (to what it computed in the set) and evaluates both sets
    work, cut = tmp_path / "work", next(iter(_yaml(TINY)["experiments"]))
    record = json.loads((work / "study.json").read_text())
    for step in record["steps"]:
        cut_steps = ("train@1", "train@2", "evaluate@1", "evaluate@2")
        step.update(status="failed (timeout)" if step["step"] in cut_steps else step["status"])
    (work / "study.json").write_text(json.dumps(record))
    models = work / "repo" / "models"
    trained = {e: json.loads((models / e / "metrics.json").read_text()) for e in _yaml(TINY)["experiments"]}
    untouched = {e: (models / e / "metrics.json").stat().st_mtime_ns for e in trained if e != cut}
    shutil.rmtree(models / cut)
    shutil.rmtree(work / "repo/reports/eval")  # no evaluation ran: none is left out as finished
    out = tmp_path / "out-resumed"
    rec = device.run_study(tmp_path / "no-carry", out, TINY, work, budget_s=900, resume=True, train_processes=2)
    # the set holding the unfinished run trains again; the other set's runs all finished: not restarted
    assert rec["complete"] and sorted(s["step"] for s in rec["steps"]) == ["evaluate@1", "evaluate@2", "train@1"]
    assert [len(c["steps"]) for c in rec["earlier_calls"]] == [len(record["steps"])]
    again = json.loads((models / cut / "metrics.json").read_text())
    assert {k: v for k, v in again.items() if k not in ("seconds_per_round", "peak_rss_mb")} == {
        k: v for k, v in trained[cut].items() if k not in ("seconds_per_round", "peak_rss_mb")
    }
    assert {e: (models / e / "metrics.json").stat().st_mtime_ns for e in untouched} == untouched
    section = call_report.section(out)  # what the two calls measured (no GPU samples on this CPU)
    assert "in 2 call(s) on one machine" in section and "every step completed" in section
    assert re.search(r"\| train@2 \| failed \(timeout\) \| [\d.]+ \| 1 \|", section)
    assert re.search(r"\| train@1 \| ok \| [\d.]+ \| 2 \|", section) and "2 sets in processes side by side" in section
    assert "GPU over the training step (with a finished set's evaluation beside the sets still training)" in section

    _import_checks(out, tmp_path, monkeypatch)


def _import_checks(out: Path, tmp_path: Path, monkeypatch) -> None:
    """The tiny study's import, here, of the resumed call's files, into a scratch study folder and MLflow store."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("FEDMEET_ROOT", str(tmp_path))  # MLflow artifacts under tmp_path/mlartifacts
    dest = tmp_path / "gpu-study"
    done = importer.import_study(out, dest)
    experiments = _yaml(TINY)["experiments"]
    partition = json.loads((dest / "partitions/domain/seed0.json").read_text())["clients"]
    n_test = sum(len(c["test"]) for c in partition.values())
    for name in experiments:  # every test example of every client, beam 4
        per_example = pd.read_parquet(dest / "eval" / name / "per_example.parquet")
        assert len(per_example) == n_test > 0
        assert json.loads((dest / "eval" / name / "metrics.json").read_text())["decoding"]["num_beams"] == 4
        train = json.loads((dest / "train" / name / "metrics.json").read_text())
        assert train["stopped_round"] <= 2
    assert len(done["mlflow_runs"]) == len(experiments)
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        runs = con.execute(
            "SELECT t.value, group_concat(DISTINCT m.key) FROM tags t JOIN metrics m ON m.run_uuid = t.run_uuid "
            "WHERE t.key = 'experiment' AND m.key IN ('val_loss_mean', 'client_avg/avg_ROUGE') GROUP BY t.run_uuid"
        ).fetchall()
    # one run per experiment, holding its rounds and its evaluation (not an evaluation run of its own)
    assert sorted(name for name, _ in runs) == sorted(experiments)
    assert {frozenset(keys.split(",")) for _, keys in runs} == {frozenset({"val_loss_mean", "client_avg/avg_ROUGE"})}
    assert (dest / "comparisons.csv").is_file() and (dest / "tables").is_dir()
    assert not list(dest.rglob("gate_log.parquet"))  # client token ids stay out
    readme = (dest / "README.md").read_text()
    assert "completed every step" in readme and "2 call(s)" in readme
    assert (
        "{0} runs finished training ({0} converged by the stop rule of `train.stop`) and {0} were evaluated.".format(
            len(experiments)  # every run trained, converged and was evaluated
        )
        in readme
    )
    assert "| train@2 | failed (timeout) | " in readme and "| train@1 | ok | " in readme


def tar_member(path: Path, name: str) -> str:
    with tarfile.open(path) as tar:
        return tar.extractfile(name).read().decode()


def test_a_py_spy_that_cannot_start_leaves_the_train_step_running_unsampled(tmp_path):
    """The sampler is instrumentation: a carried py-spy that cannot be executed (its mode bit lost on the way, as
    benchmarks/gpu_profile.py guards against with its chmod) must not fail the train step it samples, nor leave its
    child running unwaited while the step is recorded failed and the set's evaluation skipped."""
    spy = tmp_path / "py-spy"
    spy.write_text(f"#!{sys.executable}\n{FAKE_PY_SPY}")
    spy.chmod(0o644)  # not executable
    (tmp_path / "repo").mkdir()
    done = tmp_path / "trained"
    train = ["-c", f"import pathlib, time; time.sleep(0.3); pathlib.Path({str(done)!r}).write_text('ok')"]
    with (tmp_path / "log.txt").open("w") as log:
        steps = device.Steps({"steps": []}, log, budget_s=60, t0=time.monotonic(), py_spy=spy)
        ok = steps.lane([("train@1", train), ("evaluate@1", ["-c", "pass"])], tmp_path / "repo", dict(os.environ))
    assert [s["status"] for s in steps.record["steps"]] == ["ok", "ok"] and ok
    assert done.read_text() == "ok"  # the child ran to its end before the step was recorded


def test_a_resumed_call_trains_and_evaluates_only_the_runs_an_earlier_call_left(tmp_path):
    """The lease of 2026-11-28: the resumed call's evaluate@3 was cut after its first runs' records were written;
    the evaluation a later call resumes leaves those out, as train leaves out the runs whose records are written
    (each record is written last). A step with nothing left is dropped; other steps pass unchanged."""
    flags = [a for e in ("a-s0", "a-s1", "b-s0") for a in ("--experiment", e)]
    for record in (
        "models/a-s0/metrics.json",
        "reports/eval/a-s1/metrics.json",
        "reports/eval/b-s0/per_example.parquet",
    ):
        (tmp_path / record).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / record).write_text("{}")
    train = ("train@2", ["-m", "pipeline.train", *flags, "--no-mlflow"])
    evaluate = ("evaluate@2", ["-m", "tools.gpu_study.device", "evaluate", *flags])
    assert device.left_to_do(train, tmp_path) == (
        "train@2",
        ["-m", "pipeline.train", "--experiment", "a-s1", "--experiment", "b-s0", "--no-mlflow"],
    )
    assert device.left_to_do(evaluate, tmp_path) == (  # b-s0's evaluation was cut before its metrics.json
        "evaluate@2",
        ["-m", "tools.gpu_study.device", "evaluate", "--experiment", "a-s0", "--experiment", "b-s0"],
    )
    for e in ("a-s0", "b-s0"):
        (tmp_path / "reports/eval" / e / "metrics.json").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "reports/eval" / e / "metrics.json").write_text("{}")
    assert device.left_to_do(evaluate, tmp_path) is None
    plan = ("plan", ["-m", "pipeline.plan"])
    assert device.left_to_do(plan, tmp_path) == plan


def test_a_resumed_call_on_a_bare_machine_says_so_in_one_line(tmp_path):
    """The machine goes back 30 s after a call: a resumed call that lands on a fresh one finds no earlier call's work
    (nor a carry: it sends only py-spy). It must say that in one line, in the study.json it returns, not raise."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"no earlier call.*a fresh machine"):
        device.run_study(tmp_path / "no-carry", out, TINY, tmp_path / "work", budget_s=60, resume=True)
    assert "fresh machine" in json.loads((out / "study.json").read_text())["error"]


def test_a_detached_study_runs_on_after_its_call_and_a_later_call_collects_its_files(tmp_path):
    """The lease of 2026-11-28 (second): the machine went back between the study call and the resumed one, which
    found a fresh machine. Detached, the study runs in a session of its own through the gap: the call that starts it
    returns a snapshot of the steps so far (3) and ends, the study goes on, and a later call returns its files. Its
    budget (25 s, 20 of them kept for packing) cuts it a few seconds in, so it ends incomplete (1)."""
    m = prepare.build_carry(
        tmp_path / "lease", FIXTURES, ["qmsum", "samsum"], [], _tiny_minilm(tmp_path / "m"), room=64 * 2**20
    )
    assert set(m["calls"]) == {"carry"}
    work, first, later = tmp_path / "work", tmp_path / "out1", tmp_path / "out2"
    call = [sys.executable, "-m", "tools.gpu_study.device", "run", "--carry", str(tmp_path / "lease/carry")]
    call += ["--out", str(first), "--profile", str(TINY), "--work", str(work), "--budget", "25", "--detach", "0.5"]
    assert subprocess.run(call, cwd=ROOT, capture_output=True).returncode == 3  # the call ends, the study does not
    snapshot = json.loads((first / "study.json").read_text())
    assert "runs on" in snapshot["detached"] and snapshot["steps"][0]["step"] == "install"
    assert {p.name for p in first.iterdir()} == {"study.json", "log.tar.gz", "results.tar.gz"}
    with pytest.raises(SystemExit, match="still runs: `wait` for it"):
        device.detach([], work, tmp_path / "out3", 1)
    assert device.main(["wait", "--work", str(work), "--out", str(later), "--budget", "80"]) == 1
    final = json.loads((later / "study.json").read_text())
    assert "detached" not in final and final["complete"] is False and final["seconds"] >= 5
    assert len(final["steps"]) > len(snapshot["steps"])
    assert "budget spent" in json.dumps(final["steps"]) or "timeout" in json.dumps(final["steps"])
    assert {"log.tar.gz", "results.tar.gz", "daemon.txt"} <= {p.name for p in later.iterdir()}
    with pytest.raises(SystemExit, match="no detached study: a fresh machine"):
        device.collect(tmp_path / "bare", tmp_path / "out4", 1)
    assert "fresh machine" in json.loads((tmp_path / "out4/study.json").read_text())["error"]


def test_a_detached_study_ended_with_its_call_is_collected_at_once_as_it_stood(tmp_path):
    """Were the study's session ended with the call that started it (the tool says it is not), `wait` must not wait
    out its budget for a process that is gone: it returns at once the record the study saved as each step started
    (status 1), and the work folder holds what a resumed call goes on from."""
    import signal

    prepare.build_carry(tmp_path / "lease", FIXTURES, ["qmsum", "samsum"], [], _tiny_minilm(tmp_path / "m"), room=2**26)
    work = tmp_path / "work"
    call = [sys.executable, "-m", "tools.gpu_study.device", "run", "--carry", str(tmp_path / "lease/carry")]
    call += ["--out", str(tmp_path / "out1"), "--profile", str(TINY), "--work", str(work), "--budget", "300"]
    assert subprocess.run([*call, "--detach", "3"], cwd=ROOT, capture_output=True).returncode == 3
    os.killpg(json.loads((work / "detached/daemon.json").read_text())["pid"], signal.SIGKILL)
    start = time.monotonic()
    assert device.main(["wait", "--work", str(work), "--out", str(tmp_path / "out2"), "--budget", "300"]) == 1
    assert time.monotonic() - start < 10
    steps = json.loads((tmp_path / "out2/study.json").read_text())["steps"]
    assert ("install", "ok") in [(s["step"], s["status"]) for s in steps] and "running" in {s["status"] for s in steps}
    assert (work / "study.json").is_file() and (work / "repo/params.yaml").is_file()  # what --resume reads


def _resumable(tmp_path) -> tuple[Path, Path, Path]:
    """(the checkout, the work folder, $OUT) of a study call whose every step finished: the workspace holds the
    checkout's pipeline/ and tools/ and its params.yaml with TINY merged in (what make_workspace made of them)."""
    repo, work, out = tmp_path / "checkout", tmp_path / "work", tmp_path / "out"
    for path, text in {"pipeline/stage.py": "X = 1\n", "tools/gpu_study/device.py": "Y = 1\n"}.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    for top in ("pipeline", "tools"):
        shutil.copytree(repo / top, work / "repo" / top)
    (work / "repo/pipeline/__pycache__").mkdir()  # what the stages' imports leave there: not code that differs
    (work / "repo/pipeline/__pycache__/stage.cpython-312.pyc").write_bytes(b"compiled")
    params = {"ingest": {"datasets": []}, "partition": {"schemes": [], "seeds": []}, "experiments": {}}
    params["train"] = {"rounds": 8, "batch_size": 8}
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    params = device.merge_profile(params, _yaml(TINY))
    (work / "repo/params.yaml").write_text(yaml.safe_dump(params, sort_keys=False, width=4096))
    finished = ["install", "workspace", *(name for name, _ in device.stage_commands(params))]
    study = {"profile": "p", "budget_s": 60, "device": {}, "steps": [{"step": s, "status": "ok"} for s in finished]}
    (work / "study.json").write_text(json.dumps(study | {"seconds": 1, "complete": False}))
    return repo, work, out


def test_a_resumed_call_refuses_a_workspace_whose_code_is_not_this_checkouts(tmp_path):
    """A resumed call keeps the study call's workspace, and with it that call's copy of pipeline/ and tools/, which
    the stages run: a fix committed between the calls (a study call that failed early in a stage, then resumed with
    what the lease has left) was not what ran; the resumed call ran the old copy and failed the same way. It must
    refuse in one line (study.json's error) when the copy differs from the checkout the call was sent with, and go
    on when it is the same."""
    repo, work, out = _resumable(tmp_path)
    resume = dict(budget_s=60, repo=repo, resume=True)
    (repo / "pipeline/stage.py").write_text("X = 2\n")  # the fix, committed after the study call
    with pytest.raises(SystemExit, match=r"work/repo: its pipeline/ and tools/ are not the checkout's.*no --resume"):
        device.run_study(tmp_path / "no-carry", out, TINY, work, **resume)
    assert "not the checkout's" in json.loads((out / "study.json").read_text())["error"]
    (repo / "pipeline/stage.py").write_text("X = 1\n")
    assert device.run_study(tmp_path / "no-carry", out, TINY, work, **resume)["complete"]


def test_a_resumed_call_refuses_a_workspace_whose_params_are_not_those_it_was_sent_with(tmp_path):
    """The stages of a resumed call read the study call's merged params.yaml in the workspace; the code check covers
    pipeline/ and tools/ only, so a params.yaml or profile changed between the calls (a batch size lowered after
    the study call ran out of memory) was silently not what ran. It must refuse in one line naming the params that
    differ, and go on when the checkout's params.yaml with the profile merged is the workspace's."""
    repo, work, out = _resumable(tmp_path)
    resume = dict(budget_s=60, repo=repo, resume=True)
    original = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(original.replace("rounds: 8", "rounds: 4"))  # TINY does not set train.rounds
    profile = tmp_path / "profile.yaml"
    profile.write_text(TINY.read_text().replace("num_beams: 4", "num_beams: 2"))
    with pytest.raises(SystemExit, match=r"params\.yaml: evaluate\.num_beams, train\.rounds differ .*no --resume"):
        device.run_study(tmp_path / "no-carry", out, profile, work, **resume)
    assert "train.rounds" in json.loads((out / "study.json").read_text())["error"]
    (repo / "params.yaml").write_text(original.replace("batch_size: 8", "batch_size: 4"))  # TINY sets it: 2 ran
    assert device.run_study(tmp_path / "no-carry", out, TINY, work, **resume)["complete"]
    (repo / "params.yaml").write_text(original)
    assert device.run_study(tmp_path / "no-carry", out, TINY, work, **resume)["complete"]


def test_carried_wheels_whose_requirements_the_image_does_not_meet_fail_the_install_step(tmp_path):
    """The wheels install with --no-deps beside the image's packages (docs/gpu-lease.md), so flwr's pins on what the
    image has (protobuf, grpcio, typer) were checked nowhere: an image outside them failed only when the train step
    first imported flwr, after the data stages and the backbone's warm-up. The install step now checks every
    carried wheel's requirements against what the stages will import (the carried site first, then the image's),
    and fails in one line naming them; a requirement of an extra, or of a package the study never runs (uv), is no
    requirement there."""
    import importlib.metadata
    import zipfile

    have = importlib.metadata.version("pytest")  # a package of this interpreter: the image's here
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    meta = "Metadata-Version: 2.1\nName: needs-old\nVersion: 1.0\nRequires-Dist: pytest<1\n"
    meta += "Requires-Dist: uv>=0.12\nRequires-Dist: ray==2.55.1; extra == 'simulation'\nRequires-Dist: pytest>=1\n"
    with zipfile.ZipFile(wheels / "needs_old-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("needs_old/__init__.py", "")
        whl.writestr("needs_old-1.0.dist-info/METADATA", meta)
        whl.writestr("needs_old-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr("needs_old-1.0.dist-info/RECORD", "")
    with (tmp_path / "log.txt").open("w") as log:
        rc = device.install_wheels(wheels, site, log)
    assert (site / "needs_old").is_dir()  # installed, and refused
    assert rc == f"needs-old 1.0 needs pytest<1, here pytest {have}"


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    mod, path = name.replace("-", "_"), folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{mod}/__init__.py", "")
        whl.writestr(f"{mod}-{version}.dist-info/METADATA", meta)
        whl.writestr(
            f"{mod}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        whl.writestr(f"{mod}-{version}.dist-info/RECORD", "")
    return path


@pytest.mark.parametrize("spare_version, unmet", [("1.5", None), ("2.1", "needs probe-dep<2, here probe-dep 2.1")])
def test_a_spare_wheel_stands_in_for_an_image_package_outside_the_pins(tmp_path, spare_version, unmet):
    """On 2026-11-28 the image's packaging, protobuf, rich and typer had moved past flwr's pins, the install step
    refused, and rebuilding the carry cost the machine. The carry now holds spares (the pure-Python packages the
    image has, at the pinned versions): one is installed only where the image's version misses a requirement, and
    the requirements are checked again. Here the image lacks probe-dep: a spare that meets the pin passes, one
    that does not is refused as before; a spare nothing needs (unused-spare) is not installed."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    _wheel(wheels, "needs-probe", "1.0", ("probe-dep<2",))
    _wheel(wheels / "spare", "probe_dep", spare_version)
    _wheel(wheels / "spare", "unused-spare", "1.0")
    with (tmp_path / "log.txt").open("w") as log:
        rc = device.install_wheels(wheels, site, log)
    assert (site / "probe_dep").is_dir() and not (site / "unused_spare").exists()
    assert rc == (0 if unmet is None else f"needs-probe 1.0 {unmet}")


def test_a_spare_whose_own_pin_the_image_misses_brings_the_spare_for_it(tmp_path):
    """A spare is installed where the image's version misses a pin, "then everything is checked again": the spare's
    own requirements too, and the image's versions moved together on 2026-11-28. Where one of those misses (here the
    spare probe-dep 1.5 needs iniconfig<1, the image's is 2.x) and wheels/spare holds the pinned one, it is
    installed in turn; the install step refused instead, one spare short, with the spare it needed carried."""
    import importlib.metadata

    wheels, site = tmp_path / "wheels", tmp_path / "site"
    _wheel(wheels, "needs-probe", "1.0", ("probe-dep<2",))
    _wheel(wheels / "spare", "probe_dep", "1.5", ("iniconfig<1",))
    _wheel(wheels / "spare", "iniconfig", "0.5")
    assert importlib.metadata.version("iniconfig") >= "1"  # the image's (this interpreter's): outside the pin
    with (tmp_path / "log.txt").open("w") as log:
        rc = device.install_wheels(wheels, site, log)
    assert rc == 0 and (site / "probe_dep").is_dir() and (site / "iniconfig").is_dir()


def test_the_returned_results_leave_the_gate_logs_on_the_machine(tmp_path):
    """A finished KD run publishes models/<exp>/gate_log.parquet: a row per trained target token per round (~9 bytes
    a row as parquet; QMSum's 1,095 training examples of up to 96 target tokens: ~0.7 MiB a round), so the study's
    15 KD runs at ~25-30 rounds hold ~270 MiB, far over the 64 MiB (8 files) a call returns, which would cut
    results.tar.gz and with it every run's records. They hold client token ids (docs/privacy.md: the token gate log
    stays on the client's disk), the import leaves them out and call_report commits results.tar.gz as it came."""
    repo = tmp_path / "repo"
    run = repo / "models" / "fedkd-domain-s0"
    (run / "clients" / "Academic").mkdir(parents=True)
    for f in ("metrics.json", "rounds.json", "experiment.json", "clients/Academic/summary.json"):
        (run / f).write_text("{}")
    (run / "gate_log.parquet").write_bytes(b"PAR1")
    names = [name for _, name in device.results_members(repo)]
    assert "models/fedkd-domain-s0/metrics.json" in names and "models/fedkd-domain-s0/rounds.json" in names
    assert not [n for n in names if "gate_log" in n]


def test_the_returned_results_leave_out_the_temporaries_of_writes_in_progress_or_killed(tmp_path):
    """The stages write whole (pipeline.common.atomic): a temporary beside the target, renamed into place; a run is
    published as ``models/.<exp>.<pid>.<hex>.tmp/`` then renamed to ``models/<exp>/``. A detached study's snapshot
    packs the workspace while the stages write (a temporary listed, then renamed before it is read: the snapshot
    raised and the call returned no status 3), and a step the budget kills (SIGKILL) leaves its temporaries: the
    import took ``models/.<exp>.<pid>.<hex>.tmp/experiment.json`` for a run of its own. Temporaries stay out."""
    repo = tmp_path / "repo"
    (repo / "params.yaml").parent.mkdir(parents=True)
    (repo / "params.yaml").write_text("{}")
    for run in ("fedavg-domain-s0", ".fedavg-domain-s1.4242.abcd1234.tmp"):
        (repo / "models" / run / "clients/Academic").mkdir(parents=True)
        (repo / "models" / run / "experiment.json").write_text("{}")
        (repo / "models" / run / "clients/Academic/adapter.safetensors").write_bytes(b"w")
    (repo / "reports/train/fedavg-domain-s0").mkdir(parents=True)
    (repo / "reports/train/fedavg-domain-s0/.rounds.4242.abcd1234.tmp.json").write_text('{"cut')
    names = [name for _, name in device.results_members(repo)]
    assert "models/fedavg-domain-s0/experiment.json" in names
    assert [n for n in names if "/." in n] == []
    assert list(json.loads((repo / "weights.md5.json").read_text())) == [
        "models/fedavg-domain-s0/clients/Academic/adapter.safetensors"
    ]


def test_a_call_killed_mid_step_still_returns_the_record_of_its_steps(tmp_path):
    """The tool kills a call that overruns its limit and brings back what it left under $OUT; study.json was written
    there only when packing, so such a call returned nothing. It must hold each step so far (the finished ones ok)."""
    script = (
        "import sys, time; from pathlib import Path; from tools.gpu_study import device\n"
        "device.install_wheels = lambda *a: 0\n"
        "device.assemble_minilm = lambda *a: time.sleep(60)\n"  # a step that runs past the call's limit
        f"device.run_study(Path('no-carry'), Path({str(tmp_path / 'out')!r}), device.PROFILE, "
        f"Path({str(tmp_path / 'work')!r}), budget_s=120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    time.sleep(4)
    proc.kill()  # as the tool cuts a call at its limit
    proc.wait()
    steps = json.loads((tmp_path / "out/study.json").read_text())["steps"]
    assert [(s["step"], s["status"]) for s in steps] == [("install", "ok"), ("workspace", "running")]


def test_a_py_spy_ignoring_sigint_neither_fails_the_step_nor_keeps_its_child(tmp_path, monkeypatch):
    """py-spy's stop waited RESERVE_S / 2 inside ``finally``; its TimeoutExpired escaped it: a step whose child ended
    ok was recorded 'failed (timeout)', and a cut step's child was never killed."""
    monkeypatch.setattr(device, "RESERVE_S", 2)  # py-spy's stop waits 1 s
    spy = tmp_path / "py-spy"
    spy.write_text(
        f"#!{sys.executable}\nimport signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)\n"
    )
    spy.chmod(0o755)
    (tmp_path / "repo").mkdir()
    alive = tmp_path / "alive"
    cut = [
        "-c",
        f"import pathlib, time\nfor i in range(40):\n    time.sleep(0.1); pathlib.Path({str(alive)!r}).write_text(str(i))",
    ]
    with (tmp_path / "log.txt").open("w") as log:
        steps = device.Steps({"steps": []}, log, budget_s=30, t0=time.monotonic(), py_spy=spy)
        assert steps.lane([("train", ["-c", "pass"])], tmp_path / "repo", dict(os.environ))
        steps.budget_s = time.monotonic() - steps.t0 + 1  # the next step is cut after 1 s
        assert not steps.lane([("train@2", cut)], tmp_path / "repo", dict(os.environ))
    assert [s["status"] for s in steps.record["steps"]] == ["ok", "failed (timeout)"]
    seen = alive.read_text()
    time.sleep(0.5)
    assert alive.read_text() == seen  # the cut child is not running on


def test_the_report_joins_only_the_parts_of_the_call_it_was_given(tmp_path):
    """The keep folder holds the last call's files (reports/bench/gpu-study-call: results.tar.gz whole); a newer call
    returning results.tar.gz in parts was joined after the stale whole archive, whose members were read instead."""
    keep, returned = tmp_path / "keep", tmp_path / "returned"
    for folder, text in ((keep, b"old"), (returned, b"new")):
        folder.mkdir()
        (folder / "study.json").write_text("{}")
        device.pack(folder, "log.tar.gz", [])
        (tmp_path / "f").write_bytes(text)
        data = (device.pack(tmp_path, "results.tar.gz", [(tmp_path / "f", "f")])[0]).read_bytes()
        if folder == returned:  # as pack cuts an archive over PIECE
            (folder / "results.tar.gz.part1").write_bytes(data[:10])
            (folder / "results.tar.gz.part2").write_bytes(data[10:])
        else:
            (folder / "results.tar.gz").write_bytes(data)
    seen = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            call_report,
            "section",
            lambda folder, *_: seen.update(call_report._members(importer.archives(folder)["results.tar.gz"])) or "",
        )
        mp.setattr(call_report, "replace_section", lambda *a: None)
        call_report.report(returned, keep, tmp_path / "engine.md")
    assert seen == {"f": b"new"}


def test_convergence_rows_take_a_round_without_its_mean_as_the_stop_rule_does():
    """A round where a client lacks its validation loss has val_loss_mean None in rounds.json (training.history); the
    stop rule reads it as NaN (never a best, not a plateau). The rows must not raise on it; the power law is fitted
    to the rounds that have a mean (benchmarks.stop_rule.fit_power_law)."""
    from pipeline.experiments.train_config import StopConfig

    stop = StopConfig(enabled=True, min_rel_improvement=0.01, patience=2, max_rounds=40)
    clean = [3.0, 2.5, 2.2, 2.0, 1.9, 1.85, 1.82]
    gap = [3.0, 2.5, None, 2.0, 1.99, 1.985, 1.982]
    rounds = {f"a-s{i}": [{"val_loss_mean": v} for v in s] for i, s in enumerate((clean, gap))}
    (row,) = call_report.convergence_rows(rounds, stop)
    assert row["first"] == 3.0 and row["last"] == pytest.approx((1.82 + 1.982) / 2)
    # the gap's run: relative gains 0.005, 0.0025, 0.0015 over its best before: plateaued (< 1 % twice); clean: not
    assert row["converged"] == 1
    assert len(row["projected"]) == 2  # both runs: the gap's fitted without its round 3
    assert row["last_gain"] == pytest.approx(((1.85 - 1.82) / 1.85 + (1.985 - 1.982) / 1.985) / 2)


def test_the_report_of_a_call_killed_before_packing_says_so_in_one_line(tmp_path):
    """A call the tool killed past its limit returns study.json alone (written as each step ends); call_report, for
    'any call, finished or cut', raised KeyError: 'log.tar.gz' on it."""
    (tmp_path / "study.json").write_text(
        json.dumps({"steps": [{"step": "install", "status": "ok"}], "complete": False})
    )
    with pytest.raises(SystemExit, match=r"no log\.tar\.gz nor results\.tar\.gz: .*study\.json"):
        call_report.section(tmp_path)


def test_the_train_windows_pass_over_a_step_its_killed_call_left_running():
    """A call killed mid-train leaves its record with that step 'running' (started_at, no seconds: written as it
    started); a resumed call keeps it under earlier_calls, and call_report's GPU windows must not raise on it."""
    killed = {"budget_s": 570, "steps": [{"step": "train@1", "status": "running", "started_at": 100.0}]}
    resumed = {"budget_s": 200, "steps": [{"step": "train@1", "status": "ok", "started_at": 700.0, "seconds": 50.0}]}
    assert call_report.train_windows([killed, resumed], "", None) == [(700.0, 750.0)]


def test_every_printed_call_fits_the_tools_limits_whatever_the_lease_has_left():
    """The device tool takes a limit of at most 600 s and cuts a call at the lease's time left; the script's files come
    back only once it has packed them, within the call. Each printed call's formulas, evaluated at every
    budget_left_s a lease can show, must keep the limit within both and the wait within the limit; the detached
    study's budget, which outlasts its call, must end inside the lease before the waiting call's deadline, which the
    waiting call evaluates at what is left once the study call has waited W and returned."""
    study, wait = prepare.lease_calls({"calls": {"stage1": 1, "carry": 1}})[-2:]
    s = re.search(r"limit W \+ (\d+) s, B = budget_left_s - (\d+), W = min\(B, (\d+)\):", study).groups()
    w = re.search(r"limit W \+ (\d+) s, W = min\((\d+), budget_left_s - (\d+)\):", wait).groups()
    for left in range(120, 901):
        budget = left - int(s[1])
        waited = min(budget, int(s[2]))
        assert waited + int(s[0]) <= min(600, left) and 0 < budget <= left, left
        for gap in range(31):  # the waiting call, sent while the machine is warm: within 30 s of the study call
            later = left - waited - gap
            wait_s = min(int(w[1]), later - int(w[2]))
            assert wait_s + int(w[0]) <= min(600, later), (left, gap)
            if wait_s < int(w[1]):  # a lease the study fills: the study has ended before the waiting call stops
                assert budget < waited + gap + wait_s - device.RESERVE_S, (left, gap)


def test_the_report_of_a_call_without_archives_leaves_the_kept_call_as_it_was(tmp_path):
    """A call killed before packing (or a resumed call refused on a fresh machine) returns study.json alone, and a
    killed save may leave its half-written study.tmp beside it. call_report refuses such files in one line; it must
    do so before touching the keep folder, which holds the last packed call's evidence (the committed
    reports/bench/gpu-study-call, whose section 5 is generated from it), not after removing its archives."""
    keep, returned = tmp_path / "keep", tmp_path / "returned"
    shutil.copytree(ROOT / "reports/bench/gpu-study-call", keep)
    before = {f.name: f.read_bytes() for f in keep.iterdir()}
    returned.mkdir()
    (returned / "study.json").write_text(json.dumps({"steps": [{"step": "install", "status": "ok"}], "complete": 0}))
    (returned / "study.tmp").write_text('{"steps": [')
    md = tmp_path / "engine.md"
    md.write_text("## 5. old\n")
    with pytest.raises(SystemExit, match=r"no log\.tar\.gz nor results\.tar\.gz"):
        call_report.report(returned, keep, md)
    assert {f.name: f.read_bytes() for f in keep.iterdir()} == before
    assert md.read_text() == "## 5. old\n"


def test_the_steps_before_training_are_timed_in_the_first_call_even_when_it_was_killed_mid_train():
    """Section 5's 'steps before training took N s of the first call': from the first nvidia-smi sample (the first
    call's start) to the first call's train start. A first call killed mid-train keeps its train step 'running'
    (started_at, no seconds) and gives no GPU window; N must still be its own 160 - 100 = 60 s, not the time to the
    resumed call's train (800 - 100)."""
    params = device.merge_profile(_yaml(ROOT / "params.yaml"), _yaml(ROOT / "configs/gpu-study.yaml"))
    plan = {"step": "plan", "status": "ok", "started_at": 150.0, "seconds": 5.0}
    killed = {"budget_s": 570, "seconds": 300.0, "complete": False}
    killed["steps"] = [plan, {"step": "train@1", "status": "running", "started_at": 160.0}]
    resumed = {"budget_s": 250, "seconds": 200.0, "complete": True, "device": {"python": "3.12", "gpu": "G"}}
    resumed |= {"earlier_calls": [killed], "steps": [{"step": "train@1", "status": "ok", "started_at": 800.0}]}
    resumed["steps"][0]["seconds"] = 50.0
    smi = [(100.0, 0.0, 1.0), (820.0, 90.0, 2.0)]
    text = call_report.markdown(resumed, "", smi, {}, params)
    assert "The steps before training took 60 s of the first call." in text


def test_the_gpu_lease_docs_estimate_is_the_estimators_output():
    """docs/gpu-lease.md's expected-GPU-time table, warm-up and evaluation seconds: `python -m
    tools.gpu_study.estimate` on the committed timings and partition report, number for number."""
    from tools.gpu_study.estimate import REPO, estimate

    out = estimate([12, 40], REPO / "reports/partitions/domain-seed0.json").splitlines()
    doc = " ".join((REPO / "docs/gpu-lease.md").read_text(encoding="utf-8").split())
    rows = [line for line in out if line.startswith("|") and not line.startswith(("| rounds", "|---"))]
    assert [row.split(" | ")[0] for row in rows] == ["| 12", "| 40"]  # one row per round count asked for
    for row in rows:
        assert row in doc, row
    backbone = re.search(r"measured: (\d+) s", out[1])[1]
    evaluation = re.search(r"summed: (\d+) s", out[2])[1]
    assert f"warm-up with scoring (at most {backbone} s," in doc and f"evaluation ({evaluation} s summed" in doc


def test_the_gpu_lease_docs_measurements_are_the_committed_reports():
    """docs/gpu-lease.md quotes reports/bench/group_loss.json (25 buffers; 0.14x the time, 0.04x the bytes) and
    engine.md section 5's peak GPU memory."""
    root = Path(__file__).resolve().parents[1]
    doc = " ".join((root / "docs/gpu-lease.md").read_text(encoding="utf-8").split())
    group = json.loads((root / "reports/bench/group_loss.json").read_text())
    ratio = group["ratio"]
    assert f"{group['runs']} such buffers a micro-batch" in doc
    assert f"{ratio['seconds']:.2f}x the time, {ratio['backward_bytes']:.2f}x the bytes allocated" in doc
    peak = re.search(r"memory at most (\d+) MiB", (root / "reports/bench/engine.md").read_text())[1]
    assert f"peaked at {int(peak):,} MiB of GPU memory" in doc


def test_the_engine_reports_group_loss_sentence_is_its_json():
    """reports/bench/engine.md section 3 quotes reports/bench/group_loss.json: seconds, backward GB and operations
    one call a run against one call, with their ratios computed from the values (not the JSON's rounded ratios)."""
    root = Path(__file__).resolve().parents[1]
    text = " ".join((root / "reports/bench/engine.md").read_text(encoding="utf-8").split())
    g = json.loads((root / "reports/bench/group_loss.json").read_text())
    a, b = g["per_run"], g["one_call"]
    assert f"{g['runs']} runs x {g['rows']} target tokens at V = {g['vocab']:,}" in text
    assert (
        f"took {a['seconds']:.1f} s one call a run and {b['seconds']:.1f} s in one call ({b['seconds'] / a['seconds']:.2f}x;"
        in text
    )
    gb = f"allocated {a['backward_bytes'] / 1e9:.1f} GB and {b['backward_bytes'] / 1e9:.1f} GB"
    assert f"{gb} ({b['backward_bytes'] / a['backward_bytes']:.2f}x)" in text
    ops = f"{a['operations']:,} and {b['operations']:,} operations ({b['operations'] / a['operations']:.2f}x:"
    assert ops in text


def test_the_engine_reports_set_round_sentences_are_its_json():
    """reports/bench/engine.md section 3 quotes reports/bench/set_round.json's "before"/"after" and "5b2c32e-96"."""
    root = Path(__file__).resolve().parents[1]
    text = " ".join((root / "reports/bench/engine.md").read_text(encoding="utf-8").split())
    rec = json.loads((root / "reports/bench/set_round.json").read_text())
    b, a, big = rec["before"], rec["after"], rec["5b2c32e-96"]
    host, cpu = "host_seconds_per_round", "host_cpu_seconds_per_round"
    assert (
        f"went from {b[host]:.2f} s to {a[host]:.2f} s ({a[host] / b[host]:.2f}x; all threads' CPU seconds "
        f"{b[cpu]:.2f} -> {a[cpu]:.2f}, {a[cpu] / b[cpu]:.2f}x), {b[host] / b['runs']:.2f} -> "
        f"{a[host] / a['runs']:.2f} s a run-round"
    ) in text
    stacked = "stacked_seconds_per_round"
    assert f"took {b[stacked]:.1f} and {a[stacked]:.1f} s in the two records" in text
    assert (
        f"Host (b): {big[host]:.2f} s wall and {big[cpu]:.2f} CPU s a round ({big[host] / big['runs']:.2f} s and "
        f"{big[cpu] / big['runs']:.2f} CPU s a run-round)"
    ) in text


def test_the_gpu_lease_docs_call_settings_are_the_tools_and_the_profiles():
    """docs/gpu-lease.md's settings: the study's arms and seeds (configs/gpu-study.yaml) and how
    --train-processes 3 splits them, the calls' limits and budgets (prepare.lease_calls), the study call's packing
    reserve, nvidia-smi interval, returned-file piece and py-spy rate (tools/gpu_study/device.py), the evaluation's
    sources a generate call and decoding batch, the backbone warm-up's steps, and the tiny profile's arms x seeds."""
    from pipeline.results.evaluation import GENERATE_ROWS

    doc = " ".join((ROOT / "docs/gpu-lease.md").read_text(encoding="utf-8").split())
    source = (ROOT / "tools/gpu_study/device.py").read_text()

    def arms_and_seeds(path: Path) -> tuple[int, int]:
        runs = yaml.safe_load(path.read_text())["experiments"].values()
        return len({r["method"] + str(r.get("tau_scale", "")) for r in runs}), len({r["seed"] for r in runs})

    arms, seeds = arms_and_seeds(ROOT / "configs/gpu-study.yaml")
    assert f"`configs/gpu-study.yaml` ({arms} arms x {seeds} paired seeds" in doc
    names = list(yaml.safe_load((ROOT / "configs/gpu-study.yaml").read_text())["experiments"])
    sets = device.train_sets(names, 3)
    assert len(sets) == 3 and {len(s) for s in sets} == {len(names) // 3} and len(names) == arms * seeds
    assert f"trains the {len(names)} runs as three sets of {({2: 'two'})[arms // 3]} whole arms each" in doc
    assert (
        "corpora of tests/fixtures/mirror, {} arms x {} seeds)".format(
            *arms_and_seeds(ROOT / "tools/gpu_study/tiny-profile.yaml")
        )
        in doc
    )
    stage, study, wait = prepare.lease_calls({"calls": {"stage1": 1, "carry": 1}})
    limit = re.search(r"limit (\d+) s", stage)[1]
    study_b = re.search(r"limit W \+ (\d+) s, B = budget_left_s - (\d+), W = min\(B, (\d+)\)", study).groups()
    wait_b = re.search(r"limit W \+ (\d+) s, W = min\((\d+), budget_left_s - (\d+)\)", wait).groups()
    assert f"a {limit} s limit for each stage folder the carry needs" in doc
    assert f"`budget_left_s`) less {study_b[1]} s, the call waits W = B or {study_b[2]} s, whichever is less" in doc
    assert f"and its limit is {study_b[0]} s above W" in doc
    assert f"its budget what is left less {wait_b[2]} s (or {wait_b[1]} s, whichever is less) and its limit" in doc
    assert f"limit {wait_b[0]} s above it:" in doc
    assert f"the rest skipped, {device.RESERVE_S} s kept for packing)" in doc
    smi, rate = re.search(r'"-l", "(\d+)"', source)[1], re.search(r'"-r", "(\d+)"', source)[1]
    assert f"samples `nvidia-smi` every {smi} s" in doc
    assert f"any file over {device.PIECE // 2**20} MiB is cut into" in doc
    assert f"threads ({rate} samples/s, without pausing them)" in doc
    profile = yaml.safe_load((ROOT / "configs/gpu-study.yaml").read_text())
    evaluate, warmup = profile["evaluate"], profile["backbone"]["warmup"]
    calls = f"most {GENERATE_ROWS} sources a call, each call's runs of one batch length (no row is padding)"
    assert f"{calls}; decoding batch {evaluate['batch_size']} x" in doc
    assert f"x {evaluate['num_beams']} beams a run: `evaluate.batch_size` in the profile)" in doc
    assert f"its {warmup['steps']:,} steps ran at" in doc and warmup["fused_adamw"] is True


def test_the_gpu_lease_docs_warm_up_pace_is_the_committed_calls_backbone_record():
    """docs/gpu-lease.md: the GPU study call's warm-up "1,200 steps ran at 11 steps/s with the per-tensor loop, 108
    of the backbone step's 149 s": reports/bench/gpu-study-call-2026-11-26's backbone record (results.tar.gz) and
    study.json (it read 107 s, tqdm's 01:47, for the record's 108.0)."""
    call = ROOT / "reports/bench/gpu-study-call-2026-11-26"
    with tarfile.open(call / "results.tar.gz") as tar:
        warmup = json.loads(tar.extractfile("reports/backbone.json").read())["warmup"]
    step = next(s for s in json.loads((call / "study.json").read_text())["steps"] if s["step"] == "backbone")
    doc = " ".join((ROOT / "docs/gpu-lease.md").read_text(encoding="utf-8").split())
    assert (
        f"its {warmup['steps']:,} steps ran at {warmup['steps'] / warmup['seconds']:.0f} steps/s with the per-tensor "
        f"loop, {warmup['seconds']:.0f} of the backbone step's {step['seconds']:.0f} s)"
    ) in doc


def test_the_gpu_lease_docs_second_lease_is_its_kept_calls():
    """docs/gpu-lease.md's second lease of 2026-11-28: the backbone step, both warm-ups, the train steps' seconds and
    the warm-up losses where they part, read from the two leases' kept files."""
    doc = " ".join((ROOT / "docs/gpu-lease.md").read_text(encoding="utf-8").split())
    first, second = ROOT / "reports/bench/gpu-study-call", ROOT / "reports/bench/gpu-study-call-2026-11-28b"

    def kept(call: Path) -> tuple[dict, dict]:
        with tarfile.open(call / "results.tar.gz") as tar:
            warmup = json.loads(tar.extractfile("reports/backbone.json").read())["warmup"]
        return warmup, {s["step"]: s for s in json.loads((call / "study.json").read_text())["steps"]}

    (w1, _), (w2, steps) = kept(first), kept(second)
    assert f"the backbone step {steps['backbone']['seconds']:.1f} s, its warm-up {w2['seconds']:.1f} s" in doc
    assert f"against the first lease's {w1['seconds']:.1f} s" in doc
    train = {int(s["seconds"]) for name, s in steps.items() if name.startswith("train@")}
    assert train == {442} and "trained side by side for 442 s" in doc
    assert all(s["status"] == "failed (timeout)" for n, s in steps.items() if n.startswith("train@"))
    logs = [{e["step"]: e["loss"] for e in w["loss_log"]} for w in (w1, w2)]
    parted = min(step for step in logs[0] if logs[0][step] != logs[1][step])
    assert logs[0][25] == logs[1][25] and logs[0][50] == logs[1][50] and parted == 75
    assert f"reads {logs[0][75]} and then {logs[1][75]} at step 75" in doc
    refused = json.loads((second / "resumed-call-study.json").read_text())
    assert refused["complete"] is False and "a fresh machine" in refused["error"]


def test_the_import_of_a_call_cut_before_any_run_finished_writes_the_readme_not_a_traceback(tmp_path, monkeypatch):
    """The lent H100's call (reports/bench/gpu-study-call-2026-11-26: every run cut mid-training, no evaluation)
    published no models/<exp>/, so its results hold no run record; the import's README has a 'did NOT complete'
    branch for such a study, but log_runs listed the runs folder the unpack never made: FileNotFoundError after
    reports/gpu-study was half written. Such a study has no run to log (30 rounds.json, no experiment.json) and
    tables with nothing made."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("FEDMEET_ROOT", str(tmp_path))
    dest = tmp_path / "gpu-study"
    done = importer.import_study(ROOT / "reports/bench/gpu-study-call-2026-11-26", dest)
    assert done["mlflow_runs"] == [] and done["complete"] is False
    assert len(list((dest / "train").glob("*/rounds.json"))) == 30
    assert "did NOT complete (see the steps): 0 runs finished training" in (dest / "README.md").read_text()
    assert "no evaluated experiment" in done["not_made"]["main table"]


def test_the_import_of_another_leases_study_replaces_the_folder_not_merges_into_it(tmp_path):
    """docs/gpu-lease.md: the next lease repeats the whole study "and its import replaces this one". The import laid
    the new call's files over the folder: the second lease of 2026-11-28 (14 runs finished, none evaluated) imported
    into reports/gpu-study (the first lease's) read "30 runs finished training (30 converged ...) and 21 were
    evaluated", the first lease's evaluations of other runs counted and tabled as its own. Another study's folder
    is replaced; a later call of the same study (a resumed call, or the end of a detached one) is laid over it."""
    dest = tmp_path / "gpu-study"
    shutil.copytree(ROOT / "reports/gpu-study", dest)
    (dest / "eval/fedkd-domain-s0/marker").write_text("the same study's")
    importer.unpack(ROOT / "reports/bench/gpu-study-call", dest)  # the same study's last call again: laid over it
    assert (dest / "eval/fedkd-domain-s0/marker").is_file()
    study = importer.unpack(ROOT / "reports/bench/gpu-study-call-2026-11-28b", dest)
    assert "14 runs finished training (14 converged by the stop rule of `train.stop`) and 0 were evaluated" in (
        importer.readme(dest, study)
    )
    assert not (dest / "eval").exists() and len(list(dest.glob("runs/*/metrics.json"))) == 14


def test_the_report_of_a_call_that_stopped_before_its_workspace_says_so_in_one_line(tmp_path):
    """A study call on a machine that went back after the staging call (it finds no staged weight parts) or whose
    wheels do not install stops before its workspace: it packs log.tar.gz and an empty results.tar.gz (no repo).
    call_report, for 'any call, finished or cut', raised KeyError: 'params.yaml' on those files; it must say in one
    line that the call stopped before its workspace and where its steps are."""
    m = prepare.build_carry(tmp_path / "lease", FIXTURES, ["qmsum", "samsum"], [], _tiny_minilm(tmp_path / "m"), 2**20)
    assert [c for c in m["calls"] if c != "carry"]  # the weights need a staging call, not sent here
    out = tmp_path / "out"
    rec = device.run_study(tmp_path / "lease/carry", out, TINY, tmp_path / "work", 60, stage_dir=tmp_path / "bare")
    assert [(s["step"], s["status"][:6]) for s in rec["steps"]] == [("install", "ok"), ("workspace", "failed")]
    with pytest.raises(SystemExit, match=r"no params\.yaml in results\.tar\.gz: .*before its workspace.*study\.json"):
        call_report.section(out)


def test_the_import_of_a_call_that_stopped_before_its_workspace_says_so_in_one_line_writing_nothing(tmp_path):
    """The same call (no staged weight parts: its workspace step failed) returns an empty results.tar.gz; the import
    wrote device/ into the study folder, then raised ConfigError '<dest>/params.yaml: parameter file not found (run
    from the project root)' from log_runs. It must refuse in one line, before writing anything."""
    m = prepare.build_carry(tmp_path / "lease", FIXTURES, ["qmsum", "samsum"], [], _tiny_minilm(tmp_path / "m"), 2**20)
    assert [c for c in m["calls"] if c != "carry"]
    out, dest = tmp_path / "out", tmp_path / "gpu-study"
    device.run_study(tmp_path / "lease/carry", out, TINY, tmp_path / "work", 60, stage_dir=tmp_path / "bare")
    with pytest.raises(SystemExit, match=r"no params\.yaml in results\.tar\.gz: .*before its workspace.*study\.json"):
        importer.import_study(out, dest)
    assert not dest.exists()


def test_a_staging_call_that_finds_no_weight_parts_fails_in_one_line(tmp_path):
    """A staging call whose folder did not travel (carry not named, or a prepare that made no such folder) staged
    nothing, printed nothing and exited 0: the lease went on to the 600 s study call, which then stops at its workspace
    ('send the staging call first'). It must fail there, in one line naming the folder."""
    with pytest.raises(SystemExit, match=r"stage1: no weights\.part\* to stage"):
        device.stage(tmp_path / ".gpu-study/stage1", stage_dir=tmp_path / "staged")
    assert not (tmp_path / "staged").exists()


def _imported_call(tmp_path, monkeypatch) -> tuple[str, Path, str]:
    """(experiment, the unpacked call's folder, the MLflow store's uri): the lent H100 call's plan and params with
    the CPU study's fedavg-domain-s0 records, a finished run not yet evaluated."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri := f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("FEDMEET_ROOT", str(tmp_path))
    exp, dest = "fedavg-domain-s0", tmp_path / "gpu-study"
    names = {"params.yaml": "params.yaml", f"models/plans/{exp}.json": f"runs/{exp}/experiment.json"}
    names["data/partitions/domain/seed0.json"] = "partitions/domain/seed0.json"
    with tarfile.open(ROOT / "reports/bench/gpu-study-call-2026-11-26/results.tar.gz") as tar:
        for name, target in names.items():
            (dest / target).parent.mkdir(parents=True, exist_ok=True)
            (dest / target).write_bytes(tar.extractfile(name).read())
    cpu = ROOT / "reports/cpu-study"  # a finished run's records (the same clients)
    metrics = json.loads((cpu / "train" / exp / "metrics.json").read_text())  # the stop outcome models/ adds
    metrics |= {"converged": False, "stopped_round": metrics["rounds"], "best_round": metrics["rounds"]}
    for folder in (dest / "runs" / exp, dest / "train" / exp):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "metrics.json").write_text(json.dumps(metrics))
    rows = []  # models/<exp>/rounds.json: a row per round and client (the report's: a row per round)
    for report_row in json.loads((cpu / "train" / exp / "rounds.json").read_text()):
        by_client: dict[str, dict] = {}
        for key, value in report_row.items():
            if "/" in key:
                by_client.setdefault(key.split("/")[0], {})[key.split("/")[1]] = value
        rows += [{"round": report_row["round"], "client": c, **fields} for c, fields in by_client.items()]
    (dest / "runs" / exp / "rounds.json").write_text(json.dumps(rows))
    return exp, dest, uri


def test_importing_a_cut_call_then_the_finished_one_logs_each_run_once(tmp_path, monkeypatch):
    """A run that finished in the study call is in both the cut call's files and the resumed call's (not trained
    again: byte for byte the same record), and docs/gpu-lease.md imports whatever call came back: each import made a
    new MLflow run of it, two runs of one training in the study (and its evaluation, which only the finished call
    has, in the newer one). An import logs each run once: the second finds it and logs only the evaluation into it,
    and a third changes nothing."""
    from mlflow.tracking import MlflowClient

    exp, dest, uri = _imported_call(tmp_path, monkeypatch)
    cpu = ROOT / "reports/cpu-study"
    client = MlflowClient(tracking_uri=uri)

    def runs() -> list:
        found = []
        for e in client.search_experiments():
            found += client.search_runs([e.experiment_id], f"tags.experiment = '{exp}'")
        return [r for r in found if "mlflow.parentRunId" not in r.data.tags]  # the clients' runs nest under it

    first = importer.log_runs(dest, "gpu")  # the cut call: trained, not evaluated
    assert len(runs()) == 1 and "client_avg/avg_ROUGE" not in runs()[0].data.metrics
    (dest / "eval" / exp).mkdir(parents=True)  # the finished call: its evaluation too
    shutil.copy(cpu / "eval" / exp / "metrics.json", dest / "eval" / exp / "metrics.json")
    assert importer.log_runs(dest, "gpu") == first
    (run,) = runs()
    assert run.info.run_id == first[0] and "client_avg/avg_ROUGE" in run.data.metrics
    histories = {k: len(client.get_metric_history(run.info.run_id, k)) for k in run.data.metrics}
    assert importer.log_runs(dest, "gpu") == first  # once more: nothing new
    assert {k: len(client.get_metric_history(run.info.run_id, k)) for k in run.data.metrics} == histories


def test_an_import_cut_before_a_runs_records_are_logged_is_imported_again(tmp_path, monkeypatch):
    """An import finds a run it logged by its records' tag and logs nothing more of it: the tag may only mark a run
    whose records are all in (its three record files as artifacts, FINISHED). An import cut while logging the
    artifacts (here the first artifact's upload fails) leaves a run a later import must not take for done."""
    from mlflow.tracking import MlflowClient

    from pipeline.results.tracking import RunLogger

    exp, dest, uri = _imported_call(tmp_path, monkeypatch)
    upload = RunLogger.log_artifact

    def cut(self, *args, **kwargs):
        raise OSError("the import was cut here")

    monkeypatch.setattr(RunLogger, "log_artifact", cut)
    with pytest.raises(OSError, match="cut here"):
        importer.log_runs(dest, "gpu")
    monkeypatch.setattr(RunLogger, "log_artifact", upload)
    (run_id,) = importer.log_runs(dest, "gpu")
    client = MlflowClient(tracking_uri=uri)
    tagged = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], "tags.`gpu_study.record` LIKE '%'"
    )
    assert [r.info.run_id for r in tagged] == [run_id]
    assert sorted(a.path for a in client.list_artifacts(run_id)) == ["experiment.json", "metrics.json", "rounds.json"]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_reimport_keeps_an_untagged_run_imported_from_another_folder(tmp_path, monkeypatch):
    """The orphan clean-up deletes only the untagged runs of this import's own folder: a run of the experiment
    imported from elsewhere without the record tag (one imported before the tag existed) is no orphan of this import
    and stays in the store (before: deleted with every untagged imported run of the experiment)."""
    from mlflow.tracking import MlflowClient

    from pipeline.results.tracking import experiment_id

    exp, dest, uri = _imported_call(tmp_path, monkeypatch)
    study = json.loads((dest / "runs" / exp / "experiment.json").read_text())["study"]
    client = MlflowClient(tracking_uri=uri)
    tags = {"experiment": exp, "imported_from": str(tmp_path / "an-earlier-call")}
    legacy = client.create_run(experiment_id(study), tags=tags).info.run_id
    client.set_terminated(legacy, "FINISHED")
    (run_id,) = importer.log_runs(dest, "gpu")
    runs = client.search_runs([experiment_id(study)], f"tags.experiment = '{exp}'")
    assert sorted(r.info.run_id for r in runs) == sorted([legacy, run_id])


@pytest.mark.parametrize("cut_at", ["artifacts", "tag"], ids=["mid-artifacts", "after-finish"])
def test_a_reimport_after_a_cut_import_leaves_one_run_of_the_record_not_an_orphan_beside_it(
    tmp_path, monkeypatch, cut_at
):
    """An import cut mid-run (uploading its records, or after finish before its record tag) left an untagged run; the
    next import logged another run beside it, and the orphan stayed in the store (RUNNING or FINISHED, no records).
    After the re-import the store holds one run of the record, with one client run per client of its partition."""
    from mlflow.tracking import MlflowClient

    from pipeline.results.tracking import RunLogger

    exp, dest, uri = _imported_call(tmp_path, monkeypatch)
    clients = sorted(json.loads((dest / "partitions/domain/seed0.json").read_text())["clients"])
    upload, tag = RunLogger.log_artifact, RunLogger.set_tags

    def cut_upload(self, *args, **kwargs):
        raise OSError("the import was cut here")

    def cut_tag(self, tags):
        if importer.IMPORTED in tags:
            raise OSError("the import was cut here")
        tag(self, tags)

    monkeypatch.setattr(RunLogger, *(("log_artifact", cut_upload) if cut_at == "artifacts" else ("set_tags", cut_tag)))
    with pytest.raises(OSError, match="cut here"):
        importer.log_runs(dest, "gpu")
    monkeypatch.setattr(RunLogger, "log_artifact", upload)
    monkeypatch.setattr(RunLogger, "set_tags", tag)
    (run_id,) = importer.log_runs(dest, "gpu")
    client = MlflowClient(tracking_uri=uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, f"tags.experiment = '{exp}'")
    assert [r.info.run_id for r in runs] == [run_id]
    children = client.search_runs(experiments, "tags.`mlflow.parentRunId` LIKE '%'")
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {run_id}
    assert sorted(r.data.tags["client"] for r in children) == clients


@pytest.mark.parametrize("n", ["0", "-2"])
def test_a_study_call_of_no_train_process_is_one_usage_line_before_any_work(tmp_path, capsys, n):
    work = tmp_path / "work"
    with pytest.raises(SystemExit) as exit_:
        device.main(["run", "--work", str(work), "--out", str(tmp_path / "out"), "--train-processes", n])
    assert exit_.value.code == 2 and f"--train-processes {n}: give 1 or more" in capsys.readouterr().err
    assert not work.exists() and not (tmp_path / "out").exists()
