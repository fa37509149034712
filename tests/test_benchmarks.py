"""The analytic FLOP model of benchmarks/flops.py against torch's own FLOP counter on the benchmarked steps."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import flops
from benchmarks.common import Shape, build_summarizer, random_batch
from benchmarks.train_step import make_steps
from pipeline.modeling.cache import PrefixCache


def tiny(arch: str) -> Shape:
    # vocab >= the MiniLM tokenizer's 30522 words (the summarizer checks the tokenizer fits the embeddings)
    return Shape(
        "tiny",
        arch,
        hidden=64,
        ffn=128,
        heads=4,
        encoder_layers=2,
        decoder_layers=4,
        vocab=30600,
        top_k=2,
        bottleneck=96,
        source_length=40,
        target_length=12,
        batch_size=2,
    )


# BART with eager attention: torch counts the attention bmm's too, so the full model must match exactly.
# BERT2BERT runs SDPA, whose fused CPU kernel the counter does not see: compare without the attention products.
@pytest.mark.parametrize("arch,attn_impl,attn", [("bart", "eager", True), ("bert2bert", None, False)])
def test_counted_flops_of_each_step_match_the_analytic_model(tmp_path, arch, attn_impl, attn):
    torch.manual_seed(0)
    shape = tiny(arch)
    model = build_summarizer(shape, attn_implementation=attn_impl)
    batch = random_batch(shape, model)
    cache = PrefixCache(tmp_path, "test", shape.model_config)

    counter = FlopCounterMode(display=False)
    with counter:
        cache.prefix_for(model, batch)  # a miss: computes the prefix
    assert counter.get_total_flops() == shape.batch_size * flops.prefix(shape, attn)

    expected = flops.step_flops(shape, attn)
    for name, step in make_steps(model, batch, cache).items():
        counter = FlopCounterMode(display=False)
        with counter:
            step()  # forward(s) + loss + backward + AdamW
        assert counter.get_total_flops() == shape.batch_size * expected[name]["total"], name
    assert cache.stats["misses"] == shape.batch_size  # every timed step read the prefix from the cache


def test_flop_model_hand_checked_pieces():
    s = Shape(
        "h",
        "bart",
        hidden=2,
        ffn=3,
        heads=1,
        encoder_layers=1,
        decoder_layers=2,
        vocab=5,
        top_k=1,
        bottleneck=4,
        source_length=3,
        target_length=2,
        batch_size=1,
    )
    # encoder layer: S(8n^2 + 4nf) + 4S^2n = 3(32 + 24) + 72 = 240
    assert flops.encoder_layer(s) == 240
    # decoder layer: T(12n^2 + 4nf) + 4T^2n + 4TSn + 4Sn^2 = 2(48 + 24) + 32 + 48 + 48 = 272
    assert flops.decoder_layer(s) == 272
    assert flops.adapter(s) == 4 * 2 * 2 * 4 and flops.head(s) == 2 * 2 * 2 * 5
    # top k = 1: backward = head dX + lowest adapter: dW of both (64) + dX of W_up only (32) = 40 + 96
    assert flops.backward(s) == 136
    steps = flops.step_flops(s)
    assert steps["prefix_cached"]["forward"] == 2 * (272 + 64 + 40)
    assert steps["naive"]["forward"] == 2 * (240 + 2 * 272 + 64 + 40)
    assert steps["shared_encoder"]["forward"] == 240 + 2 * (2 * 272 + 64 + 40)


def test_flower_wire_bytes_track_the_tensor_bytes():
    from benchmarks.communication import measure

    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}
    m = measure(state, state)
    raw = 4 * (256 * 64 + 64)
    assert m["up_tensor_bytes"] == raw
    # the reply carries the tensors plus headers, dtype/shape descriptors and the MetricRecord: a few KiB at most
    assert raw < m["up_wire_bytes"] < raw + 4096
    assert raw < m["down_wire_bytes"] < raw + 4096
    half = measure({k: v.half() for k, v in state.items()}, {k: v.half() for k, v in state.items()})
    assert half["up_wire_bytes"] - raw // 2 == pytest.approx(m["up_wire_bytes"] - raw, abs=64)  # same overhead


def test_memory_table_reads_stage_records_and_counts_bad_ones(tmp_path):
    import json

    from benchmarks.memory import collect

    (tmp_path / "train.json").write_text(
        json.dumps(
            {"stage": "train", "seconds": 12.5, "peak_rss_mb": 900.0, "finished_at": "2026-01-01T00:00:02+00:00"}
        )
    )
    (tmp_path / "ingest.json").write_text(
        json.dumps(
            {"stage": "ingest", "seconds": 3.0, "peak_rss_mb": 150.5, "finished_at": "2026-01-01T00:00:01+00:00"}
        )
    )
    (tmp_path / "broken.json").write_text("{not json")
    out = collect(tmp_path)
    assert [r["stage"] for r in out["stages"]] == ["ingest", "train"]  # in the order they finished
    assert out["max_peak_rss_stage"] == "train" and out["max_peak_rss_mb"] == 900.0
    assert out["total_seconds"] == 15.5
    assert len(out["skipped_files"]) == 1 and "broken.json" in out["skipped_files"][0]["file"]


def test_scale_exponent_is_the_log_log_slope():
    from benchmarks.scale import fit_exponent

    assert fit_exponent([1, 10, 100], [2.0, 20.0, 200.0]) == 1.0  # linear
    assert fit_exponent([1, 2, 4], [3.0, 12.0, 48.0]) == 2.0  # quadratic
    assert fit_exponent([3, 30], [5.0, 5.0]) == 0.0  # constant
    assert fit_exponent([3], [1.0]) is None and fit_exponent([3, 10], [0.0, 1.0]) is None  # < 2 usable points


def test_scale_benchmark_core_at_two_sizes_in_process(tmp_path):
    import math

    from benchmarks import readme
    from benchmarks.scale import ScaleConfig, bench_scale

    torch.set_num_threads(1)
    cfg = ScaleConfig(sizes=(2, 4), engines=("inprocess",), rounds=2)
    res = bench_scale(cfg, work=tmp_path, isolate=False)
    assert [(p["engine"], p["clients"], p["status"]) for p in res["points"]] == [
        ("inprocess", 2, "ok"),
        ("inprocess", 4, "ok"),
    ]
    for p in res["points"]:
        n = p["clients"]
        assert p["train_examples"] == cfg.train_per_client * n  # the whole pool is partitioned
        assert p["train_per_client_min"] >= 1
        assert [r["round"] for r in p["rounds"]] == [1, 2]
        for r in p["rounds"]:
            assert r["clients_replied"] == n  # every client trained every round
            for key in ("seconds", "wall_seconds", "driver_peak_mb", "tree_peak_mb"):
                assert math.isfinite(r[key]) and r[key] > 0, (n, key, r[key])
            assert r["processes"] == 1  # in-process: no worker processes
            # one process: a sampled RSS cannot exceed the kernel's high-water mark of the same window (the 2 MiB
            # allow for a sample taken just before the reset at the round boundary)
            assert r["tree_peak_mb"] <= r["driver_peak_mb"] + 2
        for key in ("median_round_seconds", "first_round_seconds", "median_driver_peak_mb", "median_tree_peak_mb"):
            assert math.isfinite(p[key]) and p[key] > 0
    fit = res["fits"]["inprocess"]
    assert fit["sizes"] == [2, 4]
    assert isinstance(fit["median_round_seconds"]["exponent"], float)
    section = "\n".join(readme.scale_section(res))
    assert "| inprocess | 4 |" in section and "Fitted exponent" in section


def test_repro_profile_copies_only_stage_written_inputs_and_reports_ratios():
    from types import SimpleNamespace

    from benchmarks import repro_profile as rp

    dep = lambda p: SimpleNamespace(def_path=p)  # noqa: E731
    stage = SimpleNamespace(
        deps=[
            dep("pipeline/train.py"),
            dep("models/plans/a.json"),
            dep("models/backbone"),
            dep("data/processed/examples.parquet"),
        ]
    )
    outputs = {"models/plans", "models/backbone", "data/processed/examples.parquet"}
    assert rp.tracked_inputs(stage, outputs) == [
        "models/plans/a.json",
        "models/backbone",
        "data/processed/examples.parquet",
    ]
    result = {
        "baseline": "b",
        "candidate": "c",
        "repeats": 1,
        "machine": "m",
        "measured_at": "t",
        "stages": {
            "backbone": {
                "baseline": {"work_seconds": 200.0, "peak_rss_mb": 0.0},
                "candidate": {"work_seconds": 250.0, "peak_rss_mb": 0.0},
            }
        },
    }
    rows = [line for line in rp.markdown(result).splitlines() if line.startswith("| backbone")]
    assert rows == [
        "| backbone | work_seconds | 200.00 | 250.00 | 1.25 |",
        "| backbone | peak_rss_mb | 0.00 | 0.00 | - |",
    ]


def test_the_group_loss_benchmark_compares_the_same_gradients_and_counts_the_per_run_buffers(tmp_path):
    """benchmarks/group_loss.py: both ways give the logits the same gradient; one call a run allocates in its
    backward at least a gradient buffer of the whole group's logits a run (autograd's slice backward), one call
    for the group about two (its gradient, scaled)."""
    import json

    from benchmarks import group_loss

    runs, rows, vocab = 5, 16, 50
    group = group_loss._group(runs, rows, vocab, torch.Generator().manual_seed(1))
    grads = []
    for way in (group_loss.per_run, group_loss.one_call):
        z_l, total = way(*group)
        total.backward()
        grads.append(z_l.grad)
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0
    group_loss.main(
        [
            "--runs",
            str(runs),
            "--rows",
            str(rows),
            "--vocab",
            str(vocab),
            "--repeats",
            "1",
            "--out",
            str(tmp_path / "g.json"),
        ]
    )
    record = json.loads((tmp_path / "g.json").read_text())
    logits = runs * rows * vocab * 4
    assert record["per_run"]["backward_bytes"] >= runs * logits
    assert logits <= record["one_call"]["backward_bytes"] < 3 * logits
    assert record["ratio"]["operations"] < 1


def test_the_committed_repro_profile_is_the_rendering_of_its_json():
    """reports/bench/repro.md (the stage profile docs/performance.md points to: 5376257 against the 150 x 8 warm-up)
    is benchmarks.repro_profile's rendering of reports/bench/repro.json; nothing checked it."""
    import json
    from pathlib import Path

    from benchmarks import repro_profile as rp

    bench = Path(__file__).resolve().parents[1] / "reports/bench"
    assert (bench / "repro.md").read_text() == rp.markdown(json.loads((bench / "repro.json").read_text()))


def test_repro_profile_gives_no_ratio_of_negative_residuals():
    # exit_seconds is a residual (wall - startup - work) and comes out negative when the records' rounding exceeds
    # the exit; candidate -0.02 s against baseline -0.04 s is the later exit, yet -0.02 / -0.04 = 0.5 reads "faster".
    from benchmarks import repro_profile as rp

    sides = {"baseline": {"exit_seconds": -0.04}, "candidate": {"exit_seconds": -0.02}}
    result = {"baseline": "b", "candidate": "c", "repeats": 1, "machine": "m", "measured_at": "t"}
    rows = [r for r in rp.markdown({**result, "stages": {"postag": sides}}).splitlines() if r.startswith("| postag")]
    assert rows == ["| postag | exit_seconds | -0.04 | -0.02 | - |"]


def test_compare_reports_masks_measurement_keys_not_results_that_contain_their_letters():
    # VOLATILE_KEY matched substrings: "Committee" (commit), "avg_speakers" (peak), "word_updates" (date) were left
    # out of every comparison, so a refactor that moved the Committee client's losses passed as "no result changed".
    from benchmarks.compare_reports import diff_csv, diff_json

    old = {"Committee/val_loss": 1.0, "avg_speakers": 4.0, "round1_update_norms": [0.5], "seconds": 3.0}
    new = {"Committee/val_loss": 2.0, "avg_speakers": 5.0, "round1_update_norms": [0.6], "seconds": 9.0}
    assert diff_json(old, new, 1e-6) == [
        ".Committee/val_loss: 1.0 -> 2.0",
        ".avg_speakers: 4.0 -> 5.0",
        ".round1_update_norms[0]: 0.5 -> 0.6",
    ]  # the wall time alone is a measurement
    assert diff_csv("client,Committee,peak_rss_mb\na,1.0,10\n", "client,Committee,peak_rss_mb\na,2.0,20\n", 1e-6) == [
        "row 0 Committee: 1.0 -> 2.0"
    ]


def test_the_benchmarks_name_a_bad_params_value_with_its_file_as_the_stages_do(tmp_path):
    """benchmarks' params (their --params: a study's, not always ./params.yaml) go through the stages' reading,
    pipeline.common.cli.read_params: a bad value is one line "<file> <group>.<key>"."""
    import re

    import yaml

    from benchmarks.common import load_model_config
    from benchmarks.run import study_uses
    from pipeline.common.config import ConfigError

    (path := tmp_path / "study.yaml").write_text(yaml.safe_dump({"model": {"top_k": 0}, "train": {"rounds": 0}}))
    with pytest.raises(ConfigError, match=re.escape(f"{path} model.top_k")):
        load_model_config(str(path))
    with pytest.raises(ConfigError, match=re.escape(f"{path} train.rounds")):
        study_uses(str(path))
    path.write_text(yaml.safe_dump({"train": {"rounds": 3, "local_epochs": 2}, "experiments": {"a": {}, "b": {}}}))
    assert study_uses(str(path))["all 2 experiments of params.yaml"] == 12
