"""benchmarks/gpu_profile.py: the GPU profile's report is generated from what the lease returned, and the
measurement runs end to end on this CPU (tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from benchmarks import gpu_profile

ROOT = Path(__file__).resolve().parents[1]
RETURNED = ROOT / "reports" / "bench" / "gpu-profile"


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=UTC).timestamp()


def test_read_smi_parses_samples_and_skips_cut_lines(tmp_path, zone):
    csv = tmp_path / "smi.csv"
    csv.write_text(
        "2026/11/26 08:45:00.000, 10, 100\n"
        "2026/11/26 08:45:00.250, 30, 300\n"
        "2026/11/26 08:45:00.500, 50, 200\n"
        "2026/11/26 08:45:00.7"  # the sampler stopped mid-line
    )
    samples = gpu_profile.read_smi(csv)
    assert [(u, m) for _, u, m in samples] == [(10, 100), (30, 300), (50, 200)]
    window = gpu_profile.smi_during(samples, _stamp("2026/11/26 08:45:00.100"), _stamp("2026/11/26 08:45:00.600"))
    assert window == {"samples": 2, "util_mean": 40.0, "util_max": 50, "memory_max_mib": 300}
    assert gpu_profile.smi_during(samples, 0.0, 1.0) == {"samples": 0}


def _section(md: Path, number: int) -> str:
    text = md.read_text()
    return f"## {number}." + text.partition(f"## {number}.")[2].partition(f"\n## {number + 1}.")[0]


@pytest.mark.parametrize("number, returned", [(1, "gpu-profile"), (3, "gpu-profile-batched")])
def test_committed_report_is_the_one_generated_from_the_returned_files(number, returned, zone):
    src = ROOT / "reports" / "bench" / returned
    data = json.loads((src / "profile.json").read_text())
    spy = gpu_profile.pyspy_top(src / "pyspy-round.txt")
    expected = gpu_profile.markdown(data, gpu_profile.read_smi(src / "smi.csv"), number, spy)
    assert _section(ROOT / "reports" / "bench" / "gpu.md", number).strip() == expected.strip()
    assert data["device"].startswith("NVIDIA")  # measured on the lent GPU, not on this CPU


def test_committed_cpu_engine_section_is_the_one_generated_from_engine_json():
    """reports/bench/engine.md section 2 (this CPU, one at a time and together) is `python -m benchmarks.engine
    --render`'s rendering of reports/bench/engine.json; nothing checked it."""
    from benchmarks import engine

    record = json.loads((ROOT / "reports" / "bench" / "engine.json").read_text())
    assert _section(ROOT / "reports" / "bench" / "engine.md", 2).strip() == engine.markdown(record).strip()


def test_committed_engine_section_is_the_one_generated_from_the_returned_files(zone):
    from benchmarks import gpu_engine

    src = ROOT / "reports" / "bench" / "gpu-engine"
    log = (src / "log.txt").read_text(errors="replace").replace("\r", "\n")
    expected = gpu_engine.markdown(
        json.loads((src / "engine.json").read_text()), gpu_profile.read_smi(src / "smi.csv"), log
    )
    assert _section(ROOT / "reports" / "bench" / "engine.md", 4).strip() == expected.strip()


def test_finished_runs_reads_the_last_complete_bar_of_each_run():
    from benchmarks.gpu_engine import finished_runs

    log = (
        "a-s0 rounds:  50%|#    | 1/2 [00:07<00:07,  7.0s/round]\n"
        "a-s0 rounds: 100%|#####| 2/2 [00:15<00:00,  7.5s/round]\n"
        "b-s1 rounds: 100%|#####| 3/3 [01:02:05<00:00, 9.0s/round]\n"
        "c-s2 rounds:   0%|     | 0/2 [00:00<?, ?round/s]\n"
    )
    assert finished_runs(log) == {"a-s0": (2, 15), "b-s1": (3, 3725)}


def test_pyspy_top_counts_own_and_enclosing_frames(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text("main;train;matmul 3\nmain;train;loss 2\nmain;io 1\nbroken line\n")
    top = gpu_profile.pyspy_top(raw)
    assert top["samples"] == 6
    assert top["own"][:1] == [("matmul", 3)]
    assert dict(top["within"])["train"] == 5 and dict(top["within"])["main"] == 6
    assert gpu_profile.pyspy_top(tmp_path / "absent.txt")["samples"] == 0


def test_pyspy_top_ranks_frames_of_equal_count_alike_in_every_process(tmp_path):
    """Frames in every stack tie (engine.md section 5: main, run_set, run ... 680 samples each); they were counted
    in a set's order, which string hashing changes per process, so the committed section drifted from the one
    generated from the same files. Ties now rank outermost first, whatever PYTHONHASHSEED is."""
    raw = tmp_path / "raw.txt"
    raw.write_text("".join(f"main;run;set;step{i};kernel 2\n" for i in range(4)))
    code = f"from benchmarks import gpu_profile; print(gpu_profile.pyspy_top(__import__('pathlib').Path({str(raw)!r})))"
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env=os.environ | {"PYTHONHASHSEED": str(seed)},
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in range(6)
    }
    assert len(seen) == 1
    within = [name for name, _ in gpu_profile.pyspy_top(raw)["within"]]
    assert within[:4] == ["main", "run", "set", "kernel"]


def test_replace_section_keeps_the_other_sections(tmp_path):
    md = tmp_path / "r.md"
    md.write_text("# T\n\n## 1. a\nold one\n\n## 2. b\nold two\n\n## 3. c\nthree\n")
    gpu_profile.replace_section(md, 2, "## 2. b\nnew two\n", "T")
    assert md.read_text() == "# T\n\n## 1. a\nold one\n\n## 2. b\nnew two\n\n## 3. c\nthree\n"
    gpu_profile.replace_section(md, 4, "## 4. d\nfour\n", "T")  # a new last section
    assert md.read_text().endswith("## 3. c\nthree\n\n## 4. d\nfour\n")


@pytest.fixture
def qmsum() -> Path:
    path = ROOT.parent / "shared" / "data" / "qmsum"
    if not path.is_dir():
        pytest.skip(f"{path}: the shared QMSum data is absent")
    return path


@pytest.mark.slow
@pytest.mark.shared_data
@pytest.mark.timeout(600)
def test_measure_runs_end_to_end_on_cpu(tmp_path, qmsum):
    data = gpu_profile.measure(qmsum, tmp_path / "out", tmp_path / "work", tiny=True)
    steps = data["steps"]
    assert list(steps) == [
        "workspace",
        "round_fill_cache",
        "round",
        "evaluate_batch8",
        "evaluate_batch64",
        "round_subset",
        "round_torch_profiler",
        "round_cprofile",
        "evaluate_torch_profiler",
    ]
    assert steps["evaluate_batch8"]["examples"] == steps["evaluate_batch64"]["examples"] == 3
    assert steps["round_torch_profiler"]["top_by_host"], "the profiler recorded no operation"
    assert any(r["function"] for r in steps["round_cprofile"]["top_by_self"])
    assert data["round_tflop"] > 0
    assert json.loads((tmp_path / "out" / "profile.json").read_text())["steps"].keys() == steps.keys()
    assert "## 1. Today's path" in gpu_profile.markdown(data, [])


def test_committed_presets_table_is_the_one_generated_from_the_returned_file():
    from benchmarks import gpu_presets

    text = (ROOT / "reports" / "bench" / "gpu.md").read_text()
    section = "## 2." + text.partition("## 2.")[2].partition("\n## 3.")[0]
    record = json.loads((ROOT / "reports" / "bench" / "gpu-presets" / "presets.json").read_text())
    assert section.strip() == gpu_presets.markdown(record).strip()
    assert record["device"].startswith("NVIDIA")
    for entry in record["presets"].values():  # both precisions of every preset measured, none out of memory
        assert [r["precision"] for r in entry["runs"]] == ["float32", "bfloat16"]
        assert all("error" not in r and r["decode_batch"] == entry["shape"]["batch"] for r in entry["runs"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_presets_run_end_to_end_on_cpu_at_toy_sizes(tmp_path):
    from benchmarks import gpu_presets

    record = gpu_presets.run(tmp_path, tiny=True, tokenizer_dir=None)
    assert list(record["presets"]) == ["paper-bart-base", "paper-bart-large", "paper-led-large"]
    for entry in record["presets"].values():
        for r in entry["runs"]:
            assert r["step_s"] > 0 and r["decode_batch"] == 2
            assert r["train_examples_per_s_prefix_held"] == pytest.approx(2 / r["step_s"], rel=0.01, abs=0.1)
    assert json.loads((tmp_path / "presets.json").read_text()) == record


@pytest.mark.slow
@pytest.mark.shared_data
@pytest.mark.timeout(600)
def test_engine_measure_runs_end_to_end_on_cpu(tmp_path, qmsum):
    from benchmarks import gpu_engine

    data = gpu_engine.measure(qmsum, tmp_path / "out", tmp_path / "work", tiny=True)
    assert list(data["steps"]) == ["workspace", "warmup_fill_cache", "together", "alone"]
    assert data["runs"] == 6 and len(data["alone_runs"]) == 6  # tiny: the six arms' seed-0 runs
    assert data["steps"]["together"]["run_rounds"] == data["steps"]["alone"]["run_rounds"] == 12
    # on this CPU (float32) a run trains in the set exactly as alone
    assert data["max_abs_adapter_diff"] < 1e-5 and data["same_rounds"]
    assert data["steps"]["together"]["client_rounds_per_group"] > data["steps"]["alone"]["client_rounds_per_group"]


def test_device_busy_time_counts_each_kernel_once():
    # Under kineto an operator's row carries its kernels' device time as its own, and the kernel has a row too
    # (profile.json: aten::_efficient_attention_forward 7.25 ms and its fmha kernel 7.25 ms); user annotations
    # (Optimizer.step) span kernels as well. The device was busy for the kernels' time alone: 7.25 + 2.65 ms.
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def row(us, device, annotation=False):
        return SimpleNamespace(self_device_time_total=us, device_type=device, is_user_annotation=annotation)

    events = [
        row(7250.0, DeviceType.CPU),  # aten::_efficient_attention_forward
        row(7250.0, DeviceType.CUDA),  # fmha_cutlassF kernel
        row(2650.0, DeviceType.CPU),  # aten::max
        row(2650.0, DeviceType.CUDA),  # reduce_kernel
        row(7150.0, DeviceType.CUDA, annotation=True),  # Optimizer.step#AdamW.step
    ]
    assert gpu_profile.device_busy_seconds(events) == pytest.approx(0.0099)


def test_each_profiled_round_records_its_own_peak_gpu_memory(tmp_path, monkeypatch):
    """On a GPU, ``torch.cuda.max_memory_allocated`` is the process's peak since its last reset: nothing reset it
    between the cache-filling round and the timed one, so the timed round's peak_memory_gib was the larger of the two.
    Here CUDA's memory counters are stood in for (the fill round peaking at 5 GiB, the timed one at 2 GiB) and the
    workspace and rounds faked: each round's record is its own peak."""
    from types import SimpleNamespace  # lazy: this test's only

    import torch  # lazy: as the other tests here, torch only where a test needs it

    import benchmarks.common  # lazy: the modules measure imports lazily, patched before it runs
    import pipeline.experiments.plans  # lazy: as above
    import pipeline.train  # lazy: as above
    from benchmarks import engine  # lazy: as above

    peaks, seen = iter([5 * 2**30, 2 * 2**30]), {"peak": 0}
    monkeypatch.setattr(
        pipeline.train, "run_set", lambda plans, track: seen.update(peak=max(seen["peak"], next(peaks)))
    )
    for name, fake in {
        "is_available": lambda: True,
        "get_device_name": lambda *a: "NVIDIA stand-in",
        "synchronize": lambda *a: None,
        "reset_peak_memory_stats": lambda *a: seen.update(peak=0),
        "max_memory_allocated": lambda *a: seen["peak"],
    }.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(gpu_profile, "mm_rates", lambda: {})
    monkeypatch.setattr(engine, "build_workspace", lambda work, params, **kw: {"train": {}})
    monkeypatch.setattr(engine, "write_plans", lambda *a, **kw: [tmp_path / "plan.json"])
    monkeypatch.setattr(engine, "round_flops", lambda *a: 0.0)
    monkeypatch.setattr(pipeline.experiments.plans, "read_plan", lambda path: SimpleNamespace(model_config=None))
    monkeypatch.setattr(benchmarks.common, "default_shape", lambda *a: None)
    monkeypatch.delenv("FEDMEET_PYSPY", raising=False)
    monkeypatch.setenv("PATH", "")  # no py-spy
    monkeypatch.setenv("FEDMEET_ROOT", os.environ.get("FEDMEET_ROOT", ""))  # measure sets it: undone after
    monkeypatch.chdir(tmp_path)  # measure changes into its workspace: undone after

    steps = gpu_profile.measure(tmp_path, tmp_path / "out", tmp_path / "work", train_only=True)["steps"]
    assert {n: steps[n]["peak_memory_gib"] for n in ("round_fill_cache", "round")} == {
        "round_fill_cache": 5.0,
        "round": 2.0,
    }
