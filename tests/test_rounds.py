"""The rules of a run's rounds (pipeline.training: checkpoints, history) as units:
the best-adapter choice, the checkpoints a killed run resumes from, the rounds history and its metrics.

Properties stated: after any sequence of validation losses the best adapter is the state of the first round with
the lowest loss and the final one the last round's; a checkpoint comes back only to the plan that wrote it; a
client keeps exactly its last two round checkpoints and reads back the latest before a round with its progress,
trained flag and DP steps; the round metrics and the DVC plot rows are the rows' values, their sums and means;
publishing copies a finished run without its checkpoints and per-round gate logs.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# imported here, not only in the tests: mutmut's fork server imports the test modules once
import pipeline.federation.protocol  # noqa: F401,E402
import pipeline.training.checkpoints  # noqa: F401,E402
import pipeline.training.history  # noqa: F401,E402
from tests.errors import logs, names
from tests.test_federated import workspace, write_plan, ws  # noqa: F401  (fixtures)


def _plan(name: str, **train):
    from pipeline.federation.protocol import load_plan

    return load_plan(write_plan(name, "fedavg", **train))


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"layer0.w": torch.full((2, 3), value), "layer0.b": torch.tensor([value, -value])}


def _final(client_dir: Path, value: float) -> Path:
    """The client's final adapter holding ``_state(value)``, where keep_best_and_final writes it (a client's round
    checkpoint links it)."""
    from pipeline.modeling.adapters import adapter_file, save_adapter

    save_adapter(adapter_file(client_dir, "final"), _state(value))
    return adapter_file(client_dir, "final")


# ----------------------------------------------------------------------------------------------- best adapter
def test_initial_progress_has_no_best_round():
    from pipeline.training.checkpoints import initial_progress

    assert initial_progress() == {"best-val-loss": math.inf, "best-round": 0}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(val=st.lists(st.sampled_from([3.0, 2.5, 2.0, 2.0, 4.0, 1.5, 1.5]), min_size=1, max_size=6))
def test_best_adapter_is_the_first_round_with_the_lowest_loss_and_final_the_last(tmp_path_factory, val):
    from pipeline.modeling.adapters import adapter_file, load_adapter
    from pipeline.training.checkpoints import initial_progress, keep_best_and_final

    plan = _plan_cached()
    out = tmp_path_factory.mktemp("client")
    progress = initial_progress()
    for rnd, loss in enumerate(val, start=1):
        progress = keep_best_and_final(out, plan, "Academic", rnd, loss, _state(float(rnd)), progress)
        best_round = 1 + val[:rnd].index(min(val[:rnd]))
        assert progress == {"best-val-loss": min(val[:rnd]), "best-round": best_round}
        best, final = load_adapter(adapter_file(out, "best")), load_adapter(adapter_file(out, "final"))
        assert all(torch.equal(best[k], v) for k, v in _state(float(best_round)).items())
        assert all(torch.equal(final[k], v) for k, v in _state(float(rnd)).items())
    from safetensors import safe_open

    with safe_open(str(adapter_file(out, "best")), "pt") as f:
        meta = f.metadata()
    assert meta == {
        "experiment": plan.experiment,
        "client": "Academic",
        "round": str(best_round),
        "val_loss": f"{min(val):.6f}",
    }
    with safe_open(str(adapter_file(out, "final")), "pt") as f:
        final_meta = f.metadata()
    assert final_meta == {
        "experiment": plan.experiment,
        "client": "Academic",
        "round": str(len(val)),
        "val_loss": f"{val[-1]:.6f}",
    }


_PLAN = {}


def _plan_cached():
    """One plan for the hypothesis examples (they share the test's workspace)."""
    if "plan" not in _PLAN:
        _PLAN["plan"] = _plan("rounds-best")
    return _PLAN["plan"]


@pytest.fixture(autouse=True)
def _in_workspace(ws):
    _PLAN.clear()
    yield


def test_a_nan_loss_is_never_best():
    from pipeline.training.checkpoints import initial_progress, keep_best_and_final

    plan = _plan_cached()
    out = Path("models/rounds-nan/clients/Academic")
    progress = keep_best_and_final(out, plan, "Academic", 1, float("nan"), _state(1.0), initial_progress())
    assert progress == {"best-val-loss": math.inf, "best-round": 0}
    assert not (out / "adapter_best.safetensors").exists() and (out / "adapter_final.safetensors").exists()


# ----------------------------------------------------------------------------------------------- run checkpoints
def test_a_round_checkpoint_comes_back_only_to_its_plan(caplog):
    from pipeline.training import checkpoints

    plan = _plan("rounds-ckpt", rounds=3)
    path = checkpoints.server_checkpoint_path(plan)
    assert path == Path(plan.paths["out_dir"]) / "checkpoint" / "server.pt"
    assert checkpoints.load_round_checkpoint(path, plan) is None and not checkpoints.has_valid_checkpoint(plan)
    checkpoints.save_round_checkpoint(path, plan, 2, {"arrays": {"w": [1.0]}, "history": [{"round": 1}]})
    state = checkpoints.load_round_checkpoint(path, plan)
    assert state["round"] == 2 and state["arrays"] == {"w": [1.0]} and state["history"] == [{"round": 1}]
    assert checkpoints.has_valid_checkpoint(plan)
    other = _plan("rounds-ckpt", rounds=4)  # same experiment, another configuration
    with caplog.at_level(logging.WARNING, logger="fedmeet.train"):
        assert checkpoints.load_round_checkpoint(path, other) is None
    logs([r.getMessage() for r in caplog.records if r.name == "fedmeet.train"], str(path))
    assert not checkpoints.has_valid_checkpoint(other)


def test_a_round_checkpoint_of_other_training_code_is_not_resumed(caplog, monkeypatch):
    """A run killed under older code restarts under newer code rather than mixing two versions' rounds."""
    from pipeline.training import checkpoints

    plan = _plan("rounds-code", rounds=3)
    path = checkpoints.server_checkpoint_path(plan)
    checkpoints.save_round_checkpoint(path, plan, 2, {"history": [{"round": 1}]})
    assert checkpoints.has_valid_checkpoint(plan) and len(checkpoints.code_hash()) == 64
    monkeypatch.setattr(checkpoints, "code_hash", lambda: "0" * 64)  # the sources edited since
    with caplog.at_level(logging.WARNING, logger="fedmeet.train"):
        assert checkpoints.load_round_checkpoint(path, plan) is None
    assert any("other training code" in r.getMessage() for r in caplog.records)
    assert not checkpoints.has_valid_checkpoint(plan)


def test_a_round_checkpoint_is_not_resumed_after_the_backbone_or_the_partition_changes(caplog):
    """The plan names neither the backbone's contents (params backbone.*) nor the partition's (partition.*): a run
    killed before a rebuilt backbone or a re-partition starts over rather than mixing two trainings."""
    from pipeline.federation.protocol import load_plan
    from pipeline.training import checkpoints

    own = Path("data/partitions/reparted/seed0.json")  # the test's own: the shared workspace's stay as they are
    own.parent.mkdir(parents=True, exist_ok=True)
    own.write_bytes(Path("data/partitions/domain/seed0.json").read_bytes())
    plan = load_plan(write_plan("rounds-inputs", "fedavg", partition="reparted/seed0", rounds=3))
    path = checkpoints.server_checkpoint_path(plan)
    checkpoints.save_round_checkpoint(path, plan, 2, {"history": [{"round": 1}]})
    assert checkpoints.has_valid_checkpoint(plan)
    config = Path(plan.paths["backbone"]) / "config.json"
    original = config.read_bytes()
    config.write_text(json.dumps({**json.loads(original), "dropout": 0.25}))  # the backbone rebuilt
    try:
        with caplog.at_level(logging.WARNING, logger="fedmeet.train"):
            assert checkpoints.load_round_checkpoint(path, plan) is None
        assert any("another backbone" in r.getMessage() for r in caplog.records)
        assert not checkpoints.has_valid_checkpoint(plan)
    finally:
        config.write_bytes(original)
    assert checkpoints.has_valid_checkpoint(plan)  # the same backbone again: resumed
    partition = json.loads(Path(plan.paths["partition"]).read_text())
    first, second = list(partition["clients"])[:2]  # re-partitioned: one training example moves to another client
    partition["clients"][second]["train"].append(partition["clients"][first]["train"].pop())
    Path(plan.paths["partition"]).write_text(json.dumps(partition))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedmeet.train"):
        assert checkpoints.load_round_checkpoint(path, plan) is None
    assert any("another partition" in r.getMessage() for r in caplog.records)
    assert not checkpoints.has_valid_checkpoint(plan)


def test_a_local_checkpoint_counts_and_an_unreadable_one_does_not():
    from pipeline.training import checkpoints

    plan = _plan("rounds-local")
    path = checkpoints.local_checkpoint_path(plan)
    assert path.name == "local.pt" and path.parent == checkpoints.checkpoint_dir(plan)
    checkpoints.save_round_checkpoint(path, plan, 1, {})
    assert checkpoints.has_valid_checkpoint(plan)
    path.write_bytes(b"not a torch file")
    assert not checkpoints.has_valid_checkpoint(plan)


@pytest.mark.parametrize("damage", [lambda b: b[: len(b) // 2], lambda b: b"", lambda b: b"not a torch file"])
def test_an_unreadable_round_checkpoint_is_a_warning_naming_it_where_the_train_stage_starts_over(caplog, damage):
    # the deployed ServerApp (load_server_checkpoint) and the localhost engine's resume hint read server.pt
    # directly: a file cut short was torch's 'PytorchStreamReader failed reading zip archive' traceback, an empty
    # one an EOFError, naming no file (only the train stage's has_valid_checkpoint screened it, silently)
    from pipeline.training import checkpoints

    plan = _plan("rounds-damaged")
    path = checkpoints.server_checkpoint_path(plan)
    checkpoints.save_round_checkpoint(path, plan, 1, {"history": []})
    path.write_bytes(damage(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="fedmeet.train"):
        assert not checkpoints.has_valid_checkpoint(plan)  # the train stage's screen: it starts over, saying why
    said = [r.getMessage() for r in caplog.records if r.name == "fedmeet.train"]
    logs(said, str(path), "unreadable", "starting over")
    assert not any("delete" in m for m in said)  # it starts over itself: no advice to delete the file


@pytest.mark.parametrize("damage", [b"not a torch file", None])
def test_an_unreadable_server_checkpoint_is_one_line_naming_it_and_is_kept(damage):
    """A deployed ServerApp reads its checkpoint itself (deployment.serve): a damaged one (garbage, or a write cut
    short) raised torch's UnpicklingError / RuntimeError naming no file; now one line names the file and says how
    to start over, and the file stays for whoever looks into it."""
    from pipeline.common.schema import DataError
    from pipeline.training import checkpoints

    plan = _plan(f"rounds-damaged-{damage is None}")
    path = checkpoints.server_checkpoint_path(plan)
    checkpoints.save_round_checkpoint(path, plan, 2, {"history": []})
    assert checkpoints.load_round_checkpoint(path, plan)["round"] == 2  # the intact one is read back
    path.write_bytes(damage if damage is not None else path.read_bytes()[:-100])
    with pytest.raises(DataError) as err:
        checkpoints.load_round_checkpoint(path, plan)
    names(err.value, str(path), "delete it")
    assert path.exists() and not checkpoints.has_valid_checkpoint(plan)  # the in-process run starts over (as before)


def test_run_directory_layout():
    from pipeline.training import checkpoints

    plan = _plan("rounds-layout")
    out = Path(plan.paths["out_dir"])
    assert checkpoints.checkpoint_dir(plan) == out / "checkpoint"
    assert checkpoints.mlflow_run_id_path(plan) == out / "checkpoint" / "mlflow_run_id"
    assert checkpoints.client_output_dir(plan, "Product") == out / "clients" / "Product"
    assert checkpoints.client_checkpoint_dir(plan, "Product") == out / "checkpoint" / "clients" / "Product"


# ----------------------------------------------------------------------------------------------- client checkpoints
def test_a_client_keeps_its_last_two_round_checkpoints_and_reads_back_the_latest_before_a_round(tmp_path):
    from pipeline.modeling.adapters import load_adapter
    from pipeline.training.checkpoints import latest_client_checkpoint, write_client_checkpoint

    ckpt = tmp_path / "ckpt"
    assert latest_client_checkpoint(ckpt, before=5) is None
    for rnd in range(1, 6):
        progress = {"best-val-loss": 10.0 - rnd, "best-round": rnd}
        write_client_checkpoint(
            ckpt,
            rnd,
            _final(tmp_path / "client", float(rnd)),
            progress,
            trained=rnd > 1,
            dp_steps=3 * rnd if rnd % 2 else None,
        )
        kept = sorted(p.name for p in ckpt.iterdir())
        expected = [f"round{r:03d}.{ext}" for r in (rnd - 1, rnd) if r >= 1 for ext in ("json", "safetensors")]
        assert kept == expected
    latest = latest_client_checkpoint(ckpt, before=6)
    assert (latest.round, latest.progress, latest.trained, latest.dp_steps) == (
        5,
        {"best-val-loss": 5.0, "best-round": 5},
        True,
        15,
    )
    assert all(torch.equal(load_adapter(latest.adapter)[k], v) for k, v in _state(5.0).items())
    earlier = latest_client_checkpoint(ckpt, before=5)  # a server resumed after round 4 asks for round 5
    assert (earlier.round, earlier.trained, earlier.dp_steps) == (4, True, None)
    assert earlier.progress == {"best-val-loss": 6.0, "best-round": 4}
    assert latest_client_checkpoint(ckpt, before=4) is None  # round 3's is gone


def test_an_untrained_client_checkpoint_says_so(tmp_path):
    from pipeline.training.checkpoints import latest_client_checkpoint, write_client_checkpoint

    ckpt = tmp_path / "ckpt"
    progress = {"best-val-loss": 2.0, "best-round": 1}
    write_client_checkpoint(ckpt, 1, _final(tmp_path / "client", 0.0), progress, trained=False, dp_steps=0)
    ck = latest_client_checkpoint(ckpt, before=2)
    assert ck.trained is False and ck.dp_steps == 0 and ck.progress == {"best-val-loss": 2.0, "best-round": 1}
    # a checkpoint written before the flag existed counts as trained
    (ckpt / "round001.json").write_text(json.dumps({"best-val-loss": 2.0, "best-round": 1}))
    assert latest_client_checkpoint(ckpt, before=2).trained is True


@pytest.mark.parametrize(
    "text, problem", [('{"best-val-loss": 2.0, "best-ro', "not valid JSON"), ("[2.0, 1]", "expected a JSON object")]
)
def test_a_damaged_client_checkpoint_is_one_data_error_naming_it(tmp_path, text, problem):
    # a resumed client read its latest round's progress with json.loads: a file cut short was a JSONDecodeError
    # naming no file, a JSON array a TypeError from dict.pop ('pop expected at most 1 argument')
    from pipeline.common.schema import DataError
    from pipeline.training.checkpoints import latest_client_checkpoint, write_client_checkpoint

    ckpt = tmp_path / "ckpt"
    write_client_checkpoint(ckpt, 1, _final(tmp_path / "client", 1.0), {"best-round": 1}, True, None)
    (ckpt / "round001.json").write_text(text)
    with pytest.raises(DataError) as err:
        latest_client_checkpoint(ckpt, before=2)
    names(err.value, str(ckpt / "round001.json"), problem)


def test_a_stray_file_named_like_a_client_checkpoint_is_not_one(tmp_path):
    # "round002-old.safetensors" beside the checkpoints (a site's copy) was int("002-old"): a ValueError on resume
    # and on every round's write
    from pipeline.training.checkpoints import latest_client_checkpoint, write_client_checkpoint

    ckpt, out = tmp_path / "ckpt", tmp_path / "client"
    write_client_checkpoint(ckpt, 1, _final(out, 1.0), {"best-round": 1}, True, None)
    (ckpt / "round002-old.safetensors").write_bytes((ckpt / "round001.safetensors").read_bytes())
    assert latest_client_checkpoint(ckpt, before=3).round == 1
    write_client_checkpoint(ckpt, 2, _final(out, 2.0), {"best-round": 2}, True, None)
    assert latest_client_checkpoint(ckpt, before=3).round == 2 and (ckpt / "round002-old.safetensors").exists()


def test_after_writing_a_round_only_it_and_the_one_before_remain(tmp_path):
    """Whatever was there (a resumed client writes a round again): after round r is written the client holds
    exactly rounds r - 1 (if it had it) and r, and round r's content is the new one."""
    from pipeline.modeling.adapters import load_adapter
    from pipeline.training.checkpoints import write_client_checkpoint

    ckpt, out = tmp_path / "ckpt", tmp_path / "client"
    for rnd in (1, 2, 3):
        write_client_checkpoint(ckpt, rnd, _final(out, 1.0), {}, True, None)
    write_client_checkpoint(ckpt, 3, _final(out, 3.0), {}, True, None)  # resumed after round 2
    assert sorted(p.stem for p in ckpt.glob("*.safetensors")) == ["round002", "round003"]
    assert torch.equal(load_adapter(ckpt / "round003.safetensors")["layer0.w"], _state(3.0)["layer0.w"])
    write_client_checkpoint(ckpt, 2, _final(out, 2.0), {}, True, None)  # resumed after round 1
    assert sorted(p.name for p in ckpt.iterdir()) == ["round002.json", "round002.safetensors"]


@pytest.mark.parametrize("hard_links", [True, False])
def test_a_checkpoint_from_the_final_adapter_keeps_its_round_when_the_final_moves_on(tmp_path, monkeypatch, hard_links):
    """The client's checkpoint of a round is its final adapter's file (linked, or copied where the file system has
    no hard links): it reads back that round's state after later rounds replaced the final, and rounds it no
    longer keeps go without touching the final."""
    from pipeline.modeling.adapters import adapter_file, load_adapter
    from pipeline.training.checkpoints import initial_progress, keep_best_and_final, write_client_checkpoint

    if not hard_links:
        monkeypatch.setattr("os.link", lambda *a: (_ for _ in ()).throw(OSError("no hard links here")))
    plan = _plan_cached()
    out, ckpt, progress = tmp_path / "client", tmp_path / "ckpt", initial_progress()
    for rnd in (1, 2, 3):
        progress = keep_best_and_final(out, plan, "Academic", rnd, 5.0 - rnd, _state(float(rnd)), progress)
        write_client_checkpoint(ckpt, rnd, adapter_file(out, "final"), progress, True, None)
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["round002.safetensors", "round003.safetensors"]
    for rnd in (2, 3):
        assert torch.equal(
            load_adapter(ckpt / f"round{rnd:03d}.safetensors")["layer0.w"], _state(float(rnd))["layer0.w"]
        )
    for which in ("best", "final"):
        assert torch.equal(load_adapter(adapter_file(out, which))["layer0.w"], _state(3.0)["layer0.w"])


# ----------------------------------------------------------------------------------------------- history
ROWS = [
    {
        "round": 1,
        "client": "A",
        "train_loss": 2.0,
        "ce": 1.0,
        "kd": 0.5,
        "kd_fraction": 0.25,
        "val_loss": 3.0,
        "bytes_up": 100,
        "bytes_down": 200,
        "weight_share": 0.25,
        "failed": 0,
        "sampled": 1,
        "weight": 4,
    },
    {
        "round": 1,
        "client": "B",
        "val_loss": 5.0,
        "bytes_up": 0,
        "bytes_down": 50,
        "failed": 1,
        "epsilon": 2.0,
        "clipped_fraction": 0.5,
        "sampled": 1,
    },
    {"round": 1, "client": "C", "bytes_down": 7, "failed": 0, "absent": 1, "kd": None},
]


def test_gate_log_parts_merge_without_a_stray_copy_and_a_damaged_part_is_one_line_naming_it():
    """The run's gate log joins the clients' parts of rounds 1..R; a copy such as round002-old.parquet is no part (it
    was an int() ValueError), and a part cut short is one DataError naming it (it was pyarrow's traceback)."""
    from pipeline.common.schema import DataError
    from pipeline.training.client_training import GATE_LOG_DTYPES
    from pipeline.training.summary import merge_gate_logs

    plan = _plan("rounds-gate", rounds=2)
    parts = Path(plan.paths["out_dir"]) / "clients" / "Committee" / "gate_log"
    parts.mkdir(parents=True)
    for rnd in (1, 2, 3):  # round 3: beyond the run's 2 rounds (a longer run's part), left out
        row = pd.DataFrame([["Committee", rnd, f"e{rnd}", 0, 7, 0.5, True]], columns=list(GATE_LOG_DTYPES))
        row.astype(GATE_LOG_DTYPES).to_parquet(parts / f"round{rnd:03d}.parquet")
    (parts / "round002-old.parquet").write_bytes((parts / "round002.parquet").read_bytes())
    merge_gate_logs(plan)
    merged = pd.read_parquet(Path(plan.paths["out_dir"]) / "gate_log.parquet")
    assert merged["example_id"].tolist() == ["e1", "e2"] and merged["round"].tolist() == [1, 2]
    (parts / "round002.parquet").write_bytes((parts / "round002.parquet").read_bytes()[:40])
    with pytest.raises(
        DataError, match=rf"^{re.escape(str(parts / 'round002.parquet'))}: not a readable gate log part"
    ):
        merge_gate_logs(plan)


def test_round_metrics_are_the_rows_values_their_byte_sums_and_mean_validation_loss():
    from pipeline.training.history import round_metrics

    m = round_metrics(ROWS)
    assert m == {
        "A.train_loss": 2.0,
        "A.ce": 1.0,
        "A.kd": 0.5,
        "A.kd_fraction": 0.25,
        "A.val_loss": 3.0,
        "A.bytes_up": 100.0,
        "A.bytes_down": 200.0,
        "A.weight_share": 0.25,
        "A.failed": 0.0,
        "B.val_loss": 5.0,
        "B.bytes_up": 0.0,
        "B.bytes_down": 50.0,
        "B.failed": 1.0,
        "B.epsilon": 2.0,
        "B.clipped_fraction": 0.5,
        "C.bytes_down": 7.0,
        "C.failed": 0.0,
        "bytes_sent": 257.0,
        "bytes_received": 100.0,
    }  # no val_loss_mean: C has a row but no validation loss (the stop rule's round mean is NaN)
    assert all(type(v) is float for v in m.values())
    assert "val_loss_mean" not in round_metrics([{"client": "A", "bytes_up": 1}])
    assert round_metrics(ROWS[:2])["val_loss_mean"] == 4.0  # A's and B's: (3 + 5) / 2


def test_rounds_files_hold_the_history_and_one_wide_row_per_round():
    from pipeline.training.history import write_rounds

    plan = _plan("rounds-files")
    history = ROWS + [
        {"round": 2, "client": "A", "val_loss": 1.0, "bytes_up": 1, "bytes_down": 2},
        {"round": 2, "client": "B", "bytes_up": 0},
    ]
    write_rounds(plan, history[::-1])  # any order of rows
    assert json.loads((Path(plan.paths["out_dir"]) / "rounds.json").read_text()) == history[::-1]
    wide = json.loads((Path(plan.paths["reports_dir"]) / "rounds.json").read_text())
    assert [w["round"] for w in wide] == [1, 2]
    assert wide[0] == {
        "round": 1,
        "A/train_loss": 2.0,
        "A/ce": 1.0,
        "A/kd": 0.5,
        "A/kd_fraction": 0.25,
        "A/val_loss": 3.0,
        "A/bytes_up": 100,
        "A/bytes_down": 200,
        "A/weight_share": 0.25,
        "B/val_loss": 5.0,
        "B/bytes_up": 0,
        "B/bytes_down": 50,
        "B/epsilon": 2.0,
        "B/clipped_fraction": 0.5,
        "C/bytes_down": 7,
        "val_loss_mean": None,  # C has no validation loss
    }
    assert wide[1] == {
        "round": 2,
        "A/val_loss": 1.0,
        "A/bytes_up": 1,
        "A/bytes_down": 2,
        "B/bytes_up": 0,
        "val_loss_mean": None,  # B has no validation loss
    }
    write_rounds(plan, [{"round": 1, "client": "A", "bytes_up": 3}])
    assert json.loads((Path(plan.paths["reports_dir"]) / "rounds.json").read_text()) == [
        {"round": 1, "A/bytes_up": 3, "val_loss_mean": None}
    ]


class _Logger:
    def __init__(self, logged_steps):
        self.logged = {s: {} for s in logged_steps}

    def metric_history(self, key):
        from types import SimpleNamespace

        return [SimpleNamespace(step=s) for s, m in self.logged.items() if key in m or not m]

    def log_metrics(self, metrics, step):
        self.logged[step] = metrics


def test_rounds_missing_from_the_mlflow_run_are_logged_once():
    from pipeline.training.history import log_missing_rounds, round_metrics

    history = [dict(r, round=rnd) for rnd in (1, 2, 3) for r in ROWS[:2]]
    logger = _Logger([1])
    log_missing_rounds(logger, history)
    assert sorted(logger.logged) == [1, 2, 3] and logger.logged[1] == {}  # round 1 was there: not logged again
    assert logger.logged[3] == round_metrics([r for r in history if r["round"] == 3])
    logger.log_metrics = lambda metrics, step: pytest.fail(f"round {step} logged again")
    log_missing_rounds(logger, history)


def test_publishing_copies_a_finished_run_without_checkpoints_or_gate_log_parts():
    from pipeline.training import checkpoints

    plan = _plan("rounds-publish")
    out, target = Path(plan.paths["out_dir"]), Path(plan.paths["model_dir"])
    (out / "checkpoint" / "clients" / "A").mkdir(parents=True)
    (out / "checkpoint" / "server.pt").write_text("ckpt")
    for client in ("A", "B"):
        (out / "clients" / client / "gate_log").mkdir(parents=True)
        (out / "clients" / client / "gate_log" / "round001.parquet").write_text("part")
        (out / "clients" / client / "adapter_best.safetensors").write_text(client)
    (out / "clients" / "A" / "sub" / "gate_log").mkdir(parents=True)  # only a client's own gate_log is left out
    (out / "rounds.json").write_text("[]")
    (out / "gate_log.parquet").write_text("merged")
    target.mkdir(parents=True, exist_ok=True)
    (target / "stale.txt").write_text("from an earlier run")
    checkpoints.publish_outputs(plan)
    files = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
    assert files == [
        "clients",
        "clients/A",
        "clients/A/adapter_best.safetensors",
        "clients/A/sub",
        "clients/A/sub/gate_log",
        "clients/B",
        "clients/B/adapter_best.safetensors",
        "gate_log.parquet",
        "rounds.json",
    ]
    assert (target / "clients" / "B" / "adapter_best.safetensors").read_text() == "B"
    assert (out / "checkpoint" / "server.pt").exists()  # the run directory is left for the caller


def test_the_recorder_logs_metrics_and_writes_each_round():
    from pipeline.training.history import RoundLog, TrainRecorder, round_metrics

    plan = _plan("rounds-recorder", rounds=3)
    entry = RoundLog(2, 1.5, ROWS[:2])

    class Logger:
        calls = []

        def log_metrics(self, metrics, step):
            self.calls.append((metrics, step))

    recorder = TrainRecorder(Logger())
    recorder.started(plan, ["A", "B"], 2)
    recorder.round_done(plan, entry, ROWS[:2])
    recorder.close()
    assert Logger.calls == [({"round_seconds": 1.5} | round_metrics(ROWS[:2]), 2)]
    assert recorder.round_seconds == [1.5]
    assert json.loads((Path(plan.paths["out_dir"]) / "rounds.json").read_text()) == ROWS[:2]


def test_an_adapter_left_without_its_progress_by_a_kill_is_cleaned_up_not_an_error(tmp_path):
    """A kill between writing a round's adapter and its progress leaves round<r>.safetensors alone; writing a
    later round removes it like any other old checkpoint."""
    from pipeline.modeling.adapters import save_adapter
    from pipeline.training.checkpoints import latest_client_checkpoint, write_client_checkpoint

    ckpt = tmp_path / "ckpt"
    save_adapter(ckpt / "round001.safetensors", _state(1.0))  # no round001.json
    progress = {"best-val-loss": 1.0, "best-round": 3}
    write_client_checkpoint(ckpt, 3, _final(tmp_path / "client", 3.0), progress, True, None)
    assert sorted(p.name for p in ckpt.iterdir()) == ["round003.json", "round003.safetensors"]
    assert latest_client_checkpoint(ckpt, before=4).round == 3


def test_a_round_a_kill_left_without_its_progress_is_not_the_latest_checkpoint(tmp_path):
    """A kill between linking round 2's adapter and writing its progress (a SuperNode killed while the server goes
    on) leaves round002.safetensors alone: the restarted client resumes from round 1, its last complete checkpoint,
    instead of failing on the missing progress in every later round (only a written round cleans the file up)."""
    from pipeline.modeling.adapters import save_adapter
    from pipeline.training.checkpoints import latest_client_checkpoint, write_client_checkpoint

    ckpt = tmp_path / "ckpt"
    write_client_checkpoint(ckpt, 1, _final(tmp_path / "client", 1.0), {"best-val-loss": 1.0, "best-round": 1}, True, 4)
    save_adapter(ckpt / "round002.safetensors", _state(2.0))  # no round002.json
    latest = latest_client_checkpoint(ckpt, before=3)
    assert (latest.round, latest.progress, latest.dp_steps) == (1, {"best-val-loss": 1.0, "best-round": 1}, 4)
    assert latest.adapter == ckpt / "round001.safetensors"


def test_a_client_level_dp_round_is_one_epsilon_one_c_and_the_fraction_of_released_updates_clipped():
    """Client-level DP rows (by hand): A and B were aggregated (A clipped), C failed; the run-level fields are
    C = 2, a clipped fraction of 1/2 and the round's epsilon, not per-client epsilons; an absent client sent and
    received nothing."""
    from pipeline.training.history import client_level_round, round_metrics

    def row(client, **kw):
        return {"round": 1, "client": client, "sampled": 1, "failed": 0, "bytes_down": 10, "bytes_up": 4, **kw}

    rows = [
        row("C", failed=1, bytes_up=0),
        row("A", update_clipped=1, clipping_norm=2.0, epsilon=3.5, val_loss=1.0),
        row("B", update_clipped=0, clipping_norm=2.0, epsilon=3.5, val_loss=2.0),
        {"round": 1, "client": "D", "sampled": 0, "failed": 0, "absent": 1},
    ]
    assert client_level_round(rows) == {"clipping_norm": 2.0, "clipped_fraction": 0.5, "epsilon": 3.5}
    m = round_metrics(rows)
    assert (m["clipping_norm"], m["clipped_fraction"], m["epsilon"]) == (2.0, 0.5, 3.5)
    assert not any(k.endswith(".epsilon") for k in m)  # one epsilon for the federation, not per client
    assert m["C.failed"] == 1.0 and m["A.failed"] == 0.0
    assert (m["bytes_sent"], m["bytes_received"], m.get("val_loss_mean")) == (30.0, 8.0, None)  # C and D: no loss
    # no noise: no epsilon; nothing released: no run-level field
    unbounded = [dict(r, epsilon=None) if "update_clipped" in r else r for r in rows]
    assert client_level_round(unbounded) == {"clipping_norm": 2.0, "clipped_fraction": 0.5}
    assert client_level_round([rows[0], rows[3]]) == {}
    assert client_level_round([rows[0], rows[1]]) == {"clipping_norm": 2.0, "clipped_fraction": 1.0, "epsilon": 3.5}
    # example-level DP rows keep their own epsilon per client
    assert round_metrics([row("E", epsilon=1.25)])["E.epsilon"] == 1.25


def test_a_resumed_run_shows_its_progress_from_the_round_it_resumes_at(caplog):
    """Started at round 2 of 3 (a resumed run): the bar says 1 of 3 rounds done, per round, with the validation
    losses of the clients that have one; the log names the experiment, its method, the clients and the round."""
    import tqdm as tqdm_module

    from pipeline.training.history import RoundLog, TrainRecorder

    plan = _plan("rounds-progress", rounds=3)
    recorder = TrainRecorder()
    with caplog.at_level(logging.INFO, logger="fedmeet.train"):
        recorder.started(plan, ["A", "B", "C"], 2)
    logs(
        [r.getMessage() for r in caplog.records if r.name == "fedmeet.train"],
        "rounds-progress",
        "fedavg",
        "['A', 'B', 'C']",
        "2 of 3",
    )
    bar = recorder._bar
    assert (bar.n, bar.total, bar.desc, bar.unit) == (1, 3, "rounds-progress rounds", "round")
    recorder.round_done(plan, RoundLog(2, 1.5, ROWS), ROWS)
    assert bar.n == 2 and bar.postfix == "val A=3.000 B=5.000"  # C sent no validation loss
    recorder.close()
    assert bar not in tqdm_module.tqdm._instances  # closed, not left on the console


def test_a_recorder_closed_before_its_run_started_does_nothing():
    """train.py closes the recorder in a finally block: a run that fails before its first round must not raise
    a second error from there."""
    from pipeline.training.history import TrainRecorder

    TrainRecorder().close()


def test_a_checkpoint_with_numpy_arrays_and_rng_states_as_the_server_writes_it_is_resumed():
    """The server's checkpoint holds numpy arrays and the numpy RNG state (not plain tensors): it must count as
    a valid checkpoint of its plan, or every killed run would start over."""
    import numpy as np

    from pipeline.training import checkpoints

    plan = _plan("rounds-numpy-ckpt", rounds=3)
    checkpoints.save_round_checkpoint(
        checkpoints.server_checkpoint_path(plan),
        plan,
        1,
        {"arrays": {"w": np.ones((2, 2), dtype=np.float32)}, "rng": {"numpy": np.random.get_state()}},
    )
    assert checkpoints.has_valid_checkpoint(plan)


def test_publishing_creates_the_missing_parents_of_the_model_directory(monkeypatch):
    from pipeline.paths import ProjectPaths
    from pipeline.training import checkpoints

    plan = _plan("rounds-publish-parents")
    out = Path(plan.paths["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "rounds.json").write_text("[]")
    target = out.parent / "not" / "yet" / "there" / "model"
    monkeypatch.setattr(ProjectPaths, "model_dir", lambda self, experiment: target)  # e.g. models/ on a new disk
    checkpoints.publish_outputs(plan)
    assert (target / "rounds.json").read_text() == "[]"


def test_client_level_dp_rows_put_one_epsilon_per_round_in_the_rounds_file_not_one_per_client():
    """Under client-level DP the rows of aggregated clients all carry the round's epsilon; the DVC plot row has it
    once, as the run-level field, beside each client's own values."""
    from pipeline.training.history import client_level_round, write_rounds

    plan = _plan("rounds-client-dp")
    rows = [
        {
            "round": 1,
            "client": "A",
            "val_loss": 2.0,
            "bytes_up": 10,
            "epsilon": 1.5,
            "update_clipped": 1,
            "clipping_norm": 0.5,
        },
        {
            "round": 1,
            "client": "B",
            "val_loss": 4.0,
            "bytes_up": 20,
            "epsilon": 1.5,
            "update_clipped": 0,
            "clipping_norm": 0.5,
        },
        {"round": 1, "client": "C", "val_loss": 6.0, "epsilon": 3.0},
    ]  # example-level: its own epsilon
    write_rounds(plan, rows)
    [wide] = json.loads((Path(plan.paths["reports_dir"]) / "rounds.json").read_text())
    assert not any(k in wide for k in ("A/epsilon", "B/epsilon"))
    assert wide["C/epsilon"] == 3.0 and wide["epsilon"] == 1.5 == client_level_round(rows)["epsilon"]
    assert (wide["A/val_loss"], wide["B/val_loss"], wide["A/bytes_up"], wide["B/bytes_up"]) == (2.0, 4.0, 10, 20)


def test_the_plotted_round_mean_is_the_stop_rules_client_average(tmp_path):
    """A round in which a client with a row has no validation loss has no client average (training.stopping: the
    others' mean would read as a gain or a plateau), so the DVC plot, MLflow's val_loss_mean and the report's
    learning-curve data show no point there either, where they showed the mean of the clients that had one."""
    from types import SimpleNamespace

    from pipeline.paths import ProjectPaths
    from pipeline.results.figures import learning_curves
    from pipeline.results.tables import Made
    from pipeline.training.history import round_values, write_rounds
    from pipeline.training.stopping import mean_val_loss_by_round

    history = [
        {"round": 1, "client": "A", "val_loss": 3.0},
        {"round": 1, "client": "B", "val_loss": 5.0},
        {"round": 2, "client": "A", "val_loss": 1.0},
        {"round": 2, "client": "B", "failed": 1, "bytes_up": 0},  # its evaluation failed: no loss
    ]
    by_round = [[r for r in history if r["round"] == rnd] for rnd in (1, 2)]
    assert [round_values(rows, "/")["val_loss_mean"] for rows in by_round] == [4.0, None]
    assert [m for _, m in mean_val_loss_by_round(history)][0] == 4.0  # the rule: (3 + 5) / 2, then NaN
    assert math.isnan(mean_val_loss_by_round(history)[1][1])
    plan = _plan("rounds-plotted-mean")
    write_rounds(plan, history)
    paths = ProjectPaths(root=tmp_path)
    paths.train_report("exp").mkdir(parents=True)
    (paths.train_report("exp") / "rounds.json").write_bytes(
        (Path(plan.paths["reports_dir"]) / "rounds.json").read_bytes()
    )
    planned = [SimpleNamespace(name="exp", seed=0, study="main")]
    assert learning_curves(SimpleNamespace(planned=planned, labels={"exp": "fedavg"}), paths.reports, Made()) == 1
    curve = pd.read_csv(paths.plots / "learning_curves" / "main--fedavg.csv")
    assert curve["val_loss_mean"].iloc[0] == 4.0 and math.isnan(curve["val_loss_mean"].iloc[1])


def test_recorded_plotted_and_stop_rule_means_are_one_number_for_nine_clients(tmp_path):
    """With nine clients a plain left-to-right sum and numpy's pairwise sum differ in the last bit; rounds.json's
    val_loss_mean (hence MLflow's) must be the stop rule's own number, not a second computation of it."""
    losses = [8.481, 7.527, 1.022, 7.859, 1.269, 6.837, 2.405, 7.905, 5.332]
    rows = [{"round": 1, "client": f"c{i}", "val_loss": v} for i, v in enumerate(losses)]
    from pipeline.training.history import round_values
    from pipeline.training.stopping import mean_val_loss_by_round

    rule = mean_val_loss_by_round(rows)[0][1]
    assert rule == float(np.add.reduce(np.array(losses))) / 9  # numpy's pairwise order, the rule's documented one
    assert round_values(rows, "/")["val_loss_mean"] == rule
