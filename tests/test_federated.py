"""Federated training: Flower apps, strategies, engines, resume, failures, determinism, MLflow.

Everything runs on a tiny BART (tests/tiny_models.py) in a temporary workspace laid out like the repo
(data/processed/examples.parquet, data/partitions/<scheme>/seed0.json, models/backbone, models/plans).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from pipeline.experiments.settings import RunSettings
from pipeline.federation.protocol import client_settings_config
from tests.faults import killed_after_checkpoint
from tests.tiny_models import DOMAINS, MODEL, WORDS, save_tiny

if TYPE_CHECKING:
    from flwr.app import Message

N_TRAIN = {"Academic": 4, "Committee": 6, "Product": 5, "SAMSum": 4}  # unequal, so weighting matters

TRAIN = {
    "rounds": 2,
    "batch_size": 4,
    "lr": 5.0e-3,
    "new_client": "SAMSum",
    "join": {"min_rel_improvement": 0.01, "patience": 1, "max_round": 2},
    "fedopt": {"server_optimizer": "adam", "server_lr": 0.01},
    # every example (params.yaml's CPU-profile caps are the dataclass defaults)
    "max_train_examples_per_client": None,
    "max_valid_examples_per_client": None,
}
# What the engines send a client as its run-time settings (pipeline.federation.protocol.client_cache_config) when
# a test calls a ClientApp handler itself: RunSettings' defaults, as a train stage without its own would send.
CLIENT_SETTINGS = client_settings_config(RunSettings().cache)


def _examples() -> tuple[pd.DataFrame, dict, dict]:
    rows, domain_clients, extreme_clients = [], {}, {}
    for ci, dom in enumerate(DOMAINS + ["SAMSum"]):
        splits = {"train": [], "valid": [], "test": []}
        for split, n in (("train", N_TRAIN[dom]), ("valid", 2), ("test", 1)):
            for i in range(n):
                eid = f"{dom.lower()}/{split}/m{i}"
                src = f"What was said? #SEP# A: {WORDS[(i + ci) % 5]}. B: {WORDS[(i + 2 * ci + 1) % 5]}."
                rows.append(
                    {
                        "example_id": eid,
                        "dataset": "qmsum" if dom != "SAMSum" else "samsum",
                        "domain": dom,
                        "split": split,
                        "source": src,
                        "target": WORDS[(i + ci) % 5] + ".",
                    }
                )
                splits[split].append(eid)
        extreme_clients[dom] = splits
        if dom != "SAMSum":
            domain_clients[dom] = splits
    return pd.DataFrame(rows), domain_clients, extreme_clients


def _write_partition(root: Path, scheme: str, clients: dict) -> None:
    p = root / "data" / "partitions" / scheme / "seed0.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(
        json.dumps(
            {
                "scheme": scheme,
                "seed": 0,
                "params": {},
                "clients": clients,
                "excluded": {"count": 0, "by_reason": {}, "example_ids": []},
            }
        )
    )


def _write_postags(root: Path, examples: pd.DataFrame) -> None:
    """Synthetic POS tags aligned with the tokenised targets: every other target token is a 'noun or verb'."""
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.experiments.model import ModelConfig
    from pipeline.modeling.batching import IGNORE_INDEX, make_batches

    tok = AutoTokenizer.from_pretrained(root / "models" / "backbone")
    start = AutoConfig.from_pretrained(root / "models" / "backbone").decoder_start_token_id
    batches = make_batches(
        examples,
        SimpleNamespace(tokenizer=tok, decoder_start_token_id=start, pad_token_id=tok.pad_token_id),
        ModelConfig(**{k: MODEL[k] for k in ("top_k", "bottleneck", "max_source_length", "max_target_length")}),
        1,
        False,
        0,
    )
    rows = []
    for b in batches:
        labels = [int(t) for t in b.labels[0] if int(t) != IGNORE_INDEX]
        for pos, tid in enumerate(labels):
            rows.append(
                {
                    "example_id": b.example_ids[0],
                    "position": pos,
                    "token_id": tid,
                    "word_index": pos,
                    "word": f"w{pos}",
                    "pos": "NOUN" if pos % 2 == 0 else "DET",
                    "is_noun_or_verb": pos % 2 == 0,
                }
            )
    table = pd.DataFrame(rows).astype({"position": "int32"})  # as stage `postag` writes it
    table.to_parquet(root / "data" / "processed" / "postags.parquet", index=False)


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """A repo-like working directory; the tests chdir into it (stages run from the project root)."""
    # One intra-op thread: on a shared 2-core box torch's thread pool oversubscribes and every tiny op waits
    # a scheduler quantum (5x slower suite).
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("fedws")
    save_tiny("bart", root / "models" / "backbone")
    examples, domain_clients, extreme_clients = _examples()
    (root / "data" / "processed").mkdir(parents=True)
    examples.to_parquet(root / "data" / "processed" / "examples.parquet", index=False)
    _write_partition(root, "domain", domain_clients)
    _write_partition(root, "extreme", extreme_clients)
    _write_postags(root, examples)
    # A project root's params file, with the run-time settings only (RunSettings' defaults): what the train stage
    # (`--params`, default params.yaml) and a deployed ServerApp (run config `params`) read them from.
    (root / "params.yaml").write_text(yaml.safe_dump({"train": {"round_timeout_s": 86400}}))
    return root


@pytest.fixture
def ws(workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("FEDMEET_ROOT", str(workspace))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workspace / 'mlflow.db'}")
    return workspace


def write_plan(
    name: str,
    method: str,
    partition: str = "domain/seed0",
    tau: float | None = None,
    model: dict | None = None,
    **train,
) -> str:
    from pipeline.experiments.entries import Experiment
    from pipeline.experiments.methods import get_method
    from pipeline.planning import resolve_plan

    params = {"tau": 5.0, "model": {**MODEL, **(model or {})}, "train": {**TRAIN, **train}}
    # built directly, not through params' entry checks: tests also train on partitions of their own (e.g. "pair")
    entry = Experiment(
        name=name,
        method=method,
        partition=partition,
        seed=0,
        study="tests",
        tau=(tau or params["tau"]) if get_method(method).uses_tau else None,
    )
    plan = resolve_plan(entry, params)
    path = Path("models/plans") / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2, sort_keys=True))
    return str(path)


def _final_adapters(name: str) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {
        d.name: load_file(d / "adapter_final.safetensors") for d in sorted(Path(f"models/{name}/clients").iterdir())
    }


# ------------------------------------------------------------------------------------------ strategies
def _reply(arrays: dict[str, np.ndarray], metrics: dict) -> Message:
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    from pipeline.federation.engines import _set_server_identity

    _set_server_identity(1)
    ins = Message(RecordDict(), dst_node_id=7, message_type="train")
    ins.metadata.__dict__["_message_id"] = "m"
    content = RecordDict(
        {"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}), "metrics": MetricRecord(metrics)}
    )
    return Message(content, reply_to=ins)


def test_fedavg_aggregate_is_the_example_weighted_mean():
    from pipeline.federation.strategies.catalog import build_strategy

    strategy = build_strategy("fedavg", {}, fraction_train=1.0, client_lr=1e-3)
    a = _reply({"w": np.array([1.0, 2.0], dtype=np.float32)}, {"num-examples": 1, "num-steps": 1})
    b = _reply({"w": np.array([4.0, 8.0], dtype=np.float32)}, {"num-examples": 3, "num-steps": 1})
    arrays, _ = strategy.aggregate_train(1, [a, b])
    # (1 * [1, 2] + 3 * [4, 8]) / 4
    np.testing.assert_allclose(arrays["w"].numpy(), [3.25, 6.5], rtol=1e-6)


def test_fednova_normalises_updates_by_local_steps():
    from flwr.app import Array, ArrayRecord, ConfigRecord

    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import InProcessGrid, _set_server_identity
    from pipeline.federation.strategies.catalog import build_strategy

    _set_server_identity(1)  # configure_train creates Messages (run alone, no earlier test has set it)
    strategy = build_strategy("fednova", {}, fraction_train=1.0, client_lr=1e-3)
    grid = InProcessGrid(client_app, [{"client-name": "x"}, {"client-name": "y"}])
    list(
        strategy.configure_train(1, ArrayRecord({"w": Array(np.array([0.0], dtype=np.float32))}), ConfigRecord(), grid)
    )
    a = _reply({"w": np.array([1.0], dtype=np.float32)}, {"num-examples": 1, "num-steps": 1})
    b = _reply({"w": np.array([8.0], dtype=np.float32)}, {"num-examples": 3, "num-steps": 4})
    arrays, _ = strategy.aggregate_train(1, [a, b])
    # p = (1/4, 3/4); d = 1/4 * (0-1)/1 + 3/4 * (0-8)/4 = -1.75; tau_eff = 1/4 + 3 = 3.25; W = 0 + 3.25 * 1.75
    np.testing.assert_allclose(arrays["w"].numpy(), [5.6875], rtol=1e-6)
    # FedAvg would give 6.25: FedNova is not FedAvg when step counts differ
    assert abs(float(arrays["w"].numpy()[0]) - 6.25) > 0.1


def test_the_in_process_grid_keeps_a_receivers_changes_from_the_sender():
    """Server and client share only the Arrays' immutable bytes: whatever either side changes in what it received
    (a record's entries, a config's list, the metadata) stays on its side, both ways."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
    from flwr.clientapp import ClientApp

    from pipeline.federation.engines import InProcessGrid, _set_server_identity

    app, kept = ClientApp(), []

    @app.train()
    def train(msg, context):
        msg.content["arrays"]["w"] = Array(np.zeros(2, dtype=np.float32))
        del msg.content["arrays"]["v"]
        msg.content["config"]["steps"].append(99)
        msg.content["extra"] = ConfigRecord({"x": 1})
        msg.metadata.__dict__["_group_id"] = "changed"
        reply = Message(RecordDict({"arrays": ArrayRecord({"u": Array(np.ones(3, dtype=np.float32))})}), reply_to=msg)
        kept.append(reply)
        return reply

    _set_server_identity(1)
    grid = InProcessGrid(app, [{"client-name": "a"}, {"client-name": "b"}])
    downlink = ArrayRecord({"w": Array(np.arange(2, dtype=np.float32)), "v": Array(np.ones(1, dtype=np.float32))})
    sent = [
        Message(RecordDict({"arrays": downlink, "config": ConfigRecord({"steps": [1, 2]})}), n, "train", group_id="1")
        for n in grid.get_node_ids()
    ]
    replies = list(grid.send_and_receive(sent))
    for m in sent:  # both clients changed their copy of the one downlink record
        assert list(m.content["arrays"]) == ["w", "v"] and m.content["arrays"]["w"].numpy().tolist() == [0.0, 1.0]
        assert m.content["config"]["steps"] == [1, 2] and list(m.content) == ["arrays", "config"]
        assert m.metadata.group_id == "1"
    for reply in replies:  # the server changes what it got back
        reply.content["arrays"]["u"] = Array(np.zeros(1, dtype=np.float32))
        reply.content["arrays"]["t"] = Array(np.zeros(1, dtype=np.float32))
    assert [list(r.content["arrays"]) for r in kept] == [["u"], ["u"]]
    assert all(r.content["arrays"]["u"].numpy().tolist() == [1.0, 1.0, 1.0] for r in kept)


# ------------------------------------------------------------------------------------------ client reply
def test_client_reply_holds_only_adapter_tensors_and_counts(ws):
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    from pipeline.experiments.plans import read_plan
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.protocol import TRAIN_METRICS
    from pipeline.training.client_training import GATE_LOG_DTYPES
    from pipeline.training.shared_model import initial_adapter_state

    path = write_plan("reply-check", "fedselectkd")
    plan = read_plan(path)
    _set_server_identity(1)
    initial = initial_adapter_state(plan)
    msg = Message(
        RecordDict(
            {
                "arrays": ArrayRecord.from_torch_state_dict(initial),
                "config": ConfigRecord({"server-round": 1, "plan": path, **CLIENT_SETTINGS}),
            }
        ),
        dst_node_id=1000,
        message_type="train",
    )
    msg.metadata.__dict__["_message_id"] = "x"
    context = Context(
        run_id=1, node_id=1000, node_config={"client-name": "Committee"}, state=RecordDict(), run_config={}
    )
    reply = client_app(msg, context)
    content = reply.content
    assert set(content.keys()) == {"arrays", "metrics", "identity"}
    # no strings travel back but the client's name, which it gave at admission (protocol.misnamed checks it)
    assert {k: dict(v) for k, v in content.config_records.items()} == {"identity": {"client-name": "Committee"}}
    arrays = content["arrays"]
    # exactly the adapter's tensors, with the adapter's shapes: no token ids, no text
    assert set(arrays.keys()) == set(initial.keys())
    for k, a in arrays.items():
        assert tuple(a.shape) == tuple(initial[k].shape)
    metrics = content["metrics"]
    assert set(metrics.keys()) == set(TRAIN_METRICS)
    assert all(isinstance(v, (int, float)) for v in metrics.values())
    assert metrics["num-examples"] == metrics["num-trained"] == N_TRAIN["Committee"]  # no cap here
    # it trained: the local adapter moved away from the initial weights
    assert any(not np.allclose(arrays[k].numpy(), initial[k].numpy()) for k in initial)
    # the gate log stayed on the client's disk
    gate = pd.read_parquet(Path(plan.paths["out_dir"]) / "clients" / "Committee" / "gate_log" / "round001.parquet")
    assert list(gate.columns) == list(GATE_LOG_DTYPES)
    assert gate["client"].eq("Committee").all() and len(gate) == metrics["num-tokens"]


# ------------------------------------------------------------------------------------------ every method
METHOD_CASES = [
    ("single", "domain/seed0"),
    ("centralized", "domain/seed0"),
    ("fedavg", "domain/seed0"),
    ("fedkd", "domain/seed0"),
    ("fedselectkd", "domain/seed0"),
    ("fedprox", "domain/seed0"),
    ("fedopt", "domain/seed0"),
    ("fednova", "domain/seed0"),
    ("hardkd", "domain/seed0"),
    ("post_addition", "extreme/seed0"),
    ("pre_addition", "extreme/seed0"),
]


# Each case is a full tiny federated run; the single-domain cases take ~14 s idle.
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method,partition", METHOD_CASES)
def test_each_method_runs_and_writes_its_mlflow_run(ws, method, partition):
    import mlflow

    from pipeline.train import run_experiment

    name = f"m-{method}"
    metrics = run_experiment(write_plan(name, method, partition))
    clients = sorted(json.loads(Path(f"data/partitions/{partition}.json").read_text())["clients"])
    assert sorted(metrics["clients"]) == clients
    assert json.loads(Path(f"reports/train/{name}/metrics.json").read_text()) == json.loads(json.dumps(metrics))
    history = json.loads(Path(f"models/{name}/rounds.json").read_text())
    for c in clients:
        assert Path(f"models/{name}/clients/{c}/adapter_best.safetensors").exists()
        assert metrics["clients"][c]["best_val_loss"] is not None
    if method == "post_addition":  # SAMSum is absent in round 1, present in round 2
        assert {r["client"] for r in history if r["round"] == 1} == set(DOMAINS)
        assert {r["client"] for r in history if r["round"] == 2} == set(clients)
    federated = method not in ("single", "centralized")
    assert (metrics["bytes_received"] > 0) == federated
    gate = pd.read_parquet(f"models/{name}/gate_log.parquet")
    if method in ("fedkd", "fedselectkd", "hardkd", "post_addition", "pre_addition"):
        assert len(gate) > 0
        if method == "fedkd":
            assert gate["kd_applied"].all()
        if method == "hardkd":  # KD exactly on the tagged tokens (every other position)
            assert (gate["kd_applied"] == (gate["position"] % 2 == 0)).all()
    else:
        assert len(gate) == 0
    # published without the run's checkpoints and per-round gate logs, and the run directory is gone
    assert not Path(f"models/{name}/checkpoint").exists() and not list(
        Path(f"models/{name}").glob("clients/*/gate_log")
    )
    assert not any(Path("data/cache/runs").glob(f"{name}-*"))

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    runs = mlflow.search_runs(experiment_names=["tests"], filter_string=f"tags.experiment = '{name}'")
    assert len(runs) == 1
    run = runs.iloc[0]
    assert run["status"] == "FINISHED"
    assert run["tags.method"] == method and run["tags.partition"] == partition and run["tags.seed"] == "0"
    assert run["params.train.rounds"] == "2"
    assert ("params.tau" in runs.columns and run["params.tau"] == "5.0") == (
        method in ("fedselectkd", "post_addition", "pre_addition")
    )
    # each client's metrics are in its own run under the experiment's
    children = mlflow.search_runs(
        experiment_names=["tests"], filter_string=f"tags.`mlflow.parentRunId` = '{run.run_id}'"
    )
    assert sorted(children["tags.client"]) == sorted(clients) and not children["metrics.val_loss"].isna().any()
    if federated:
        assert run["metrics.bytes_received"] > 0


@pytest.mark.slow
def test_client_sampling_picks_two_of_three_each_round(ws):
    from pipeline.train import run_experiment

    run_experiment(write_plan("sampling", "fedavg", fraction_train=0.67), track=False)
    history = json.loads(Path("models/sampling/rounds.json").read_text())
    for rnd in (1, 2):
        rows = [r for r in history if r["round"] == rnd]
        assert sum(r["sampled"] for r in rows) == 2
        assert all("val_loss" in r for r in rows)  # every client still evaluates
        # a client not sampled sends nothing and receives only the evaluation copy of the average
        for r in rows:
            assert (r["bytes_up"] > 0) == bool(r["sampled"])


# ------------------------------------------------------------------------------------------ determinism, resume
def test_same_seed_gives_identical_adapters(ws):
    from pipeline.train import run_experiment

    run_experiment(write_plan("det-a", "fedselectkd"), track=False)
    run_experiment(write_plan("det-b", "fedselectkd"), track=False)
    a, b = _final_adapters("det-a"), _final_adapters("det-b")
    assert a.keys() == b.keys()
    for client in a:
        for k in a[client]:
            assert torch.equal(a[client][k], b[client][k]), (client, k)


@pytest.mark.slow
def test_killed_run_resumes_at_the_next_round(ws, monkeypatch):
    from pipeline.train import run_experiment
    from pipeline.training import client_training as local_training

    path = write_plan("resume", "fedselectkd")
    with killed_after_checkpoint(monkeypatch, rnd=1):
        run_experiment(path, track=False)
    from pipeline.experiments.plans import read_plan
    from pipeline.training.checkpoints import server_checkpoint_path

    assert torch.load(server_checkpoint_path(read_plan(path)), weights_only=False)["round"] == 1
    assert not Path("models/resume").exists()  # nothing is published before the run ends

    trained_rounds = []
    real_train = local_training.train_local

    def counting(*args, **kwargs):
        trained_rounds.append(kwargs["rnd"])
        return real_train(*args, **kwargs)

    monkeypatch.setattr(local_training, "train_local", counting)
    run_experiment(path, track=False)
    assert trained_rounds == [2, 2, 2]  # round 1 was not redone
    history = json.loads(Path("models/resume/rounds.json").read_text())
    assert sorted({r["round"] for r in history}) == [1, 2]
    # and the result is the uninterrupted run's, bit for bit (same seed: see det-a)
    if not Path("models/det-a").exists():
        run_experiment(write_plan("det-a", "fedselectkd"), track=False)
    a, b = _final_adapters("det-a"), _final_adapters("resume")
    for client in a:
        for k in a[client]:
            assert torch.equal(a[client][k], b[client][k]), (client, k)


# A run SIGKILLed at each point in turn (each rerun resumes what the previous leg left and dies at the next point),
# then run to its end: (kill point, the server checkpoint's round the kill leaves, temporaries it leaves, by glob).
KILL_LEGS = [
    ("first-round", None, []),  # nothing to resume: the rerun starts over (its MLflow run is a new one)
    ("local-training", 1, []),
    ("aggregated", 1, []),
    (
        "checkpoint-write",
        1,
        ["data/cache/runs/{exp}-*/checkpoint/.server.*.tmp.pt"],
    ),  # torn, beside the whole round-1 file
    ("between-rounds", 2, []),  # the next write of server.pt removed the torn one
    ("before-recording", 3, []),
    ("final-write", 3, ["reports/train/{exp}/.metrics.*.tmp.json"]),
    ("artifact-upload", 3, []),
]
TIMING_METRICS = {"round_seconds", "peak_rss_mb"}  # measured by whichever process ran the round


def _run_metrics(client, experiment: str, deleted: int):
    """The experiment's MLflow run, one and FINISHED, and its metric histories; besides it, ``deleted`` runs: killed
    before their first checkpoint, deleted by the rerun (docs/mlflow.md, "Interrupted runs")."""
    from mlflow.entities import ViewType

    search = functools.partial(
        client.search_runs,
        client.get_experiment_by_name("tests").experiment_id,
        filter_string=f"tags.experiment = '{experiment}'",
    )
    runs = search()
    assert [r.info.status for r in runs] == ["FINISHED"]
    gone = search(run_view_type=ViewType.DELETED_ONLY)  # SIGKILLed: left RUNNING, or closed KILLED
    assert len(gone) == deleted and all(r.data.metrics == {} for r in gone)
    run = runs[0]
    history = {
        k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)) for k in run.data.metrics
    }
    # each client's child run holds its own metrics (pipeline.results.tracking): read back as <client>.<key>
    for child in client.search_runs(
        [run.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{run.info.run_id}'"
    ):
        history |= {
            f"{child.data.tags['client']}.{k}": sorted(
                (m.step, m.value) for m in client.get_metric_history(child.info.run_id, k)
            )
            for k in child.data.metrics
        }
    return run, history


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killed_run_resumes_from_every_kill_point_to_the_uninterrupted_result(ws, tmp_path):
    """Issue 15, item 6: the train stage (3 rounds, 3 clients) SIGKILLed during local training (before the first
    checkpoint, and later), right after aggregation, inside the checkpoint write, between rounds, between a round's
    checkpoint and its recording, inside the final writes and the artifact upload; each rerun resumes after the
    last checkpointed round, and the last one ends with the uninterrupted run's adapters (bit for bit), rounds,
    best rounds, gate log and MLflow metrics."""
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient
    from reliability import KILL_POINTS, stage_env
    from reliability import REPO_ROOT as ROOT
    from safetensors import safe_open

    ref, exp = "kill-ref", "kill-resume"
    for name in (ref, exp):
        write_plan(name, "fedselectkd", rounds=3)
    legs = [[ref, ""]] + [[exp, point] for point, _, _ in KILL_LEGS] + [[exp, ""]]
    record = tmp_path / "legs.json"
    code = f"from reliability import train_legs; train_legs({legs!r}, 'models/plans', {str(record)!r}, timeout=60)"
    env = stage_env(
        FEDMEET_ROOT=str(ws),
        MLFLOW_TRACKING_URI=os.environ["MLFLOW_TRACKING_URI"],
        PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ws, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes = json.loads(record.read_text())

    def log_of(i: int) -> str:
        return Path(outcomes[i]["log"]).read_text()

    assert [o["status"] for o in outcomes] == [0] + [-9] * len(KILL_LEGS) + [0], [
        (o["point"], o["status"], log_of(i)[-2000:]) for i, o in enumerate(outcomes) if o["status"] not in (0, -9)
    ]
    previous = None
    for i, ((point, ckpt_round, temporaries), o) in enumerate(zip(KILL_LEGS, outcomes[1:]), start=1):
        assert point in KILL_POINTS
        assert o["checkpoint_round"] == ckpt_round, point
        assert len(o["temporaries"]) == len(temporaries), (point, o["temporaries"])
        for found, pattern in zip(o["temporaries"], temporaries):
            assert Path(found).match(pattern.format(exp=exp)), (point, found)
        resumed = f"{exp}: resuming after round {previous}"
        assert (resumed in log_of(i)) == (previous is not None), (point, log_of(i)[-2000:])
        previous = ckpt_round
    assert f"{exp}: resuming after round 3" in log_of(len(outcomes) - 1)
    assert outcomes[-1]["checkpoint_round"] is None and outcomes[-1]["temporaries"] == []
    assert all(o["run_dir_left"] for o in outcomes[1:-1]) and not outcomes[-1]["run_dir_left"]

    # the same adapters, bit for bit, from the same best round
    for kind in ("final", "best"):
        for client in DOMAINS:
            files = [Path(f"models/{n}/clients/{client}/adapter_{kind}.safetensors") for n in (ref, exp)]
            a, b = (safe_open(f, "pt") for f in files)
            assert a.metadata()["round"] == b.metadata()["round"], (kind, client)
            assert sorted(a.keys()) == sorted(b.keys())
            for k in a.keys():
                assert torch.equal(a.get_tensor(k), b.get_tensor(k)), (kind, client, k)
    # the same rounds (losses, best rounds, bytes) and summary, less the timings
    for rounds in ("models/{}/rounds.json", "reports/train/{}/rounds.json"):
        ra, rb = (json.loads(Path(rounds.format(n)).read_text()) for n in (ref, exp))
        assert ra == rb and len(ra) >= 3
    ma, mb = (json.loads(Path(f"models/{n}/metrics.json").read_text()) for n in (ref, exp))
    for m in (ma, mb):
        m.pop("experiment"), m.pop("seconds_per_round"), m.pop("peak_rss_mb")
    assert ma == mb
    # the same gate log: every client's every round, none lost or doubled
    ga, gb = (pd.read_parquet(f"models/{n}/gate_log.parquet") for n in (ref, exp))
    assert sorted(set(gb["round"])) == [1, 2, 3] and set(gb["client"]) == set(DOMAINS)
    pd.testing.assert_frame_equal(ga, gb)
    # one MLflow run, resumed and finished, with each metric once per step and the uninterrupted run's values
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    (_, hist_a), (run_b, hist_b) = _run_metrics(client, ref, 0), _run_metrics(client, exp, 1)
    assert run_b.info.status == "FINISHED" and run_b.data.tags["fedmeet.resumed"] == "true"
    assert set(hist_a) == set(hist_b)
    for key in set(hist_a) - TIMING_METRICS:
        assert hist_b[key] == hist_a[key], key
    steps = [s for s, _ in hist_b["round_seconds"]]
    assert len(steps) == len(set(steps)) and set(steps) <= {1, 2, 3}
    assert [s for s, _ in hist_b["Product.val_loss"]] == [1, 2, 3]
    artifacts = {a.path for a in client.list_artifacts(run_b.info.run_id, "adapters/Product")}
    assert artifacts == {"adapters/Product/adapter_best.safetensors", "adapters/Product/adapter_final.safetensors"}


@pytest.mark.slow
def test_failing_client_is_dropped_from_that_rounds_aggregate(ws, monkeypatch):
    from pipeline.federation import server_app
    from pipeline.train import run_experiment
    from pipeline.training import client_training as local_training

    real_train = local_training.train_local
    aggregated_weights = []

    def flaky(*args, **kwargs):
        if kwargs["client"] == "Committee" and kwargs["rnd"] == 1:
            raise RuntimeError("disk full on the Committee client")
        return real_train(*args, **kwargs)

    monkeypatch.setattr(local_training, "train_local", flaky)
    real_aggregate = server_app.build_strategy  # the module global run_server calls

    def spying_strategy(*args, **kwargs):
        strategy = real_aggregate(*args, **kwargs)
        inner = strategy.aggregate_train

        def aggregate(rnd, replies):
            replies = list(replies)
            aggregated_weights.append(
                sorted(int(r.content["metrics"]["num-examples"]) for r in replies if not r.has_error())
            )
            return inner(rnd, replies)

        strategy.aggregate_train = aggregate
        return strategy

    monkeypatch.setattr(server_app, "build_strategy", spying_strategy)
    metrics = run_experiment(write_plan("flaky", "fedavg"), track=False)
    history = json.loads(Path("models/flaky/rounds.json").read_text())
    committee = {r["round"]: r for r in history if r["client"] == "Committee"}
    assert committee[1]["failed"] == 1 and committee[2]["failed"] == 0
    # round 1 averaged Academic (4) and Product (5) only; round 2 all three
    assert aggregated_weights == [[4, 5], [4, 5, 6]]
    assert metrics["clients"]["Committee"]["rounds_failed"] == 1


# ------------------------------------------------------------------------------------------ transfer, weights
def _spy_run(plan_path: str) -> tuple[list[dict], list[dict], list[dict]]:
    """Run an experiment recording each client's reply before encoding (its local state, the encoded tensors)
    and what the strategy aggregated each round (the decoded replies, their weights, the result)."""
    from pipeline.federation import client_app, server_app
    from pipeline.train import run_experiment

    uplinks, aggregates = [], []
    real_encode, real_build = client_app.encode_reply, server_app.build_strategy

    def encode_spy(local, plan, received):
        record = real_encode(local, plan, received)
        uplinks.append(
            {
                "state": {k: v.clone() for k, v in local.items()},
                "received": {k: v.clone() for k, v in received.items()},
                "encoded": record.to_torch_state_dict(),
            }
        )
        return record

    def build_spy(*args, **kwargs):
        strategy = real_build(*args, **kwargs)
        inner = strategy.aggregate_train

        def aggregate(rnd, replies):
            replies = [r for r in replies if not r.has_error()]
            result = inner(rnd, replies)
            aggregates.append(
                {
                    "round": rnd,
                    "weights": [float(r.content["metrics"]["num-examples"]) for r in replies],
                    "decoded": [r.content["arrays"].to_torch_state_dict() for r in replies],
                    "result": result[0].to_torch_state_dict(),
                }
            )
            return result

        strategy.aggregate_train = aggregate
        return strategy

    with pytest.MonkeyPatch.context() as mp:  # undone after this run: spies of two runs must not stack
        mp.setattr(client_app, "encode_reply", encode_spy)  # the module global client_train calls
        mp.setattr(server_app, "build_strategy", build_spy)
        run_experiment(plan_path, track=False)
    history = json.loads(Path(f"models/{Path(plan_path).stem}/rounds.json").read_text())
    return uplinks, aggregates, history


@pytest.mark.slow
def test_transfer_encodings_shrink_bytes_and_stay_within_the_codec_bound(ws):
    from benchmarks.communication import transfer_error_bound

    wide = {"bottleneck": 256}  # big enough that the per-array .npy headers do not hide the 2x / 4x
    runs = {}
    for label, train in [
        ("fp32", {}),
        ("fp16", {"transfer_dtype": "fp16"}),
        ("int8", {"transfer_dtype": "int8"}),
        ("int8-delta", {"transfer_dtype": "int8", "transfer_delta": True, "rounds": 2}),
    ]:
        runs[label] = _spy_run(write_plan(f"transfer-{label}", "fedavg", model=wide, **{"rounds": 1, **train}))

    n_values = sum(t.numel() for t in runs["fp32"][0][0]["state"].values())
    bytes_up = {label: {r["client"]: r["bytes_up"] for r in hist} for label, (_, _, hist) in runs.items()}
    bytes_down = {label: sum(r["bytes_down"] for r in hist if r["round"] == 1) for label, (_, _, hist) in runs.items()}
    for client, up32 in bytes_up["fp32"].items():
        assert up32 - bytes_up["fp16"][client] == 2 * n_values  # 2 bytes saved per value, same headers
        assert up32 / bytes_up["fp16"][client] > 1.9
        assert up32 / bytes_up["int8"][client] > 3.4  # 4x minus one scalar scale array per tensor
        assert bytes_up["int8-delta"][client] == bytes_up["int8"][client]
    assert bytes_down["fp32"] / bytes_down["fp16"] > 1.9 and bytes_down["fp32"] / bytes_down["int8"] > 3.4

    errors = {}
    n = len(DOMAINS)
    for label, (uplinks, aggregates, _) in runs.items():
        for agg in aggregates:  # every round (the delta run has two: round 2's downlink delta is not zero)
            assert len(agg["decoded"]) == n
            sent = uplinks[(agg["round"] - 1) * n : agg["round"] * n]  # the in-process grid: message order
            p = np.array(agg["weights"]) / sum(agg["weights"])
            for key, value in agg["result"].items():
                raw_mean = sum(p_i * up["state"][key].double() for p_i, up in zip(p, sent))
                bound = 0.0
                for p_i, up, decoded in zip(p, sent, agg["decoded"]):
                    err = float((decoded[key] - up["state"][key]).abs().max())
                    if label == "fp32":
                        assert torch.equal(decoded[key], up["state"][key]), key  # exact, bit for bit
                    else:
                        # + float32 rounding of adding the decoded delta back to the reference
                        assert err <= transfer_error_bound(up["encoded"], key) + 1e-6, (label, key)
                    bound += p_i * transfer_error_bound(up["encoded"], key)
                    errors.setdefault((label, key), []).append(err)
                # the aggregate of the decoded replies is within the weighted codec bound of the exact FedAvg
                assert float((value.double() - raw_mean).abs().max()) <= bound + 1e-6, (label, key)
    # With delta encoding the round-1 downlink is the round-0 adapter plus a zero delta: exact, so the clients
    # train exactly as in the fp32 run, and the aggregate is within the codec bound of the fp32 run's.
    (up32, agg32, _), (up8, agg8, _) = runs["fp32"], runs["int8-delta"]
    for a, b in zip(up32, up8[:n]):
        assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
    p = np.array(agg8[0]["weights"]) / sum(agg8[0]["weights"])
    for key, value in agg8[0]["result"].items():
        bound = sum(p_i * transfer_error_bound(up["encoded"], key) for p_i, up in zip(p, up8[:n]))
        assert float((value - agg32[0]["result"][key]).abs().max()) <= bound + 1e-6, key
    # int8 of a LayerNorm weight near 1 rounds with a step ~1/127; as a delta the step follows the update
    norm_keys = [k for (label, k) in errors if label == "int8" and k.endswith("norm.weight")]
    assert norm_keys
    for key in norm_keys:
        assert max(errors[("int8-delta", key)]) < max(errors[("int8", key)]) / 10, key


@pytest.mark.slow
def test_fp32_transfer_is_what_the_client_holds(ws):
    """fp32 (the default) sends the state itself: the bytes of the plain ArrayRecord, decoded bit for bit."""
    from flwr.app import ArrayRecord

    uplinks, aggregates, history = _spy_run(write_plan("transfer-exact", "fedselectkd", rounds=1))
    rows = {r["client"]: r for r in history}
    for up in uplinks:
        assert set(up["encoded"]) == set(up["state"])
        for key in up["state"]:
            assert up["encoded"][key].dtype == torch.float32 and torch.equal(up["encoded"][key], up["state"][key])
    plain = ArrayRecord.from_torch_state_dict(uplinks[0]["state"]).count_bytes()
    assert all(r["bytes_up"] == plain for r in rows.values())
    for decoded, up in zip(aggregates[0]["decoded"], uplinks):
        assert all(torch.equal(decoded[k], up["state"][k]) for k in decoded)


@pytest.mark.parametrize("weight_by", ["full", "trained", None])  # None: the default, which is trained
def test_fedavg_weights_follow_the_full_train_size_under_the_cap(ws, weight_by):
    cap = 3  # below every client's train size (4, 6, 5, 4): each trains on 3 examples
    uplinks, aggregates, history = _spy_run(
        write_plan(
            f"weights-{weight_by}",
            "fedavg",
            "extreme/seed0",
            rounds=1,
            max_train_examples_per_client=cap,
            **({} if weight_by is None else {"weight_by": weight_by}),
        )
    )
    clients = sorted(N_TRAIN)
    rows = {r["client"]: r for r in history}
    assert {c: rows[c]["n_examples"] for c in clients} == {c: cap for c in clients}
    expected = {c: N_TRAIN[c] if weight_by == "full" else cap for c in clients}
    assert {c: rows[c]["weight"] for c in clients} == expected
    total = sum(expected.values())  # full: 19 = 4 + 6 + 5 + 4
    for c in clients:
        assert rows[c]["weight_share"] == pytest.approx(expected[c] / total)
    first = aggregates[0]
    # the strategy averaged with those weights: W = sum_i (w_i / sum w) W_i, recomputed by hand
    assert sorted(first["weights"]) == sorted(expected.values())
    p = np.array(first["weights"]) / total
    for key, value in first["result"].items():
        manual = sum(p_i * d[key].double() for p_i, d in zip(p, first["decoded"]))
        np.testing.assert_allclose(value.double().numpy(), manual.numpy(), rtol=1e-5, atol=1e-7)
    metrics = json.loads(Path(f"models/weights-{weight_by}/metrics.json").read_text())
    assert metrics["clients"]["Committee"]["fedavg_weight"] == expected["Committee"]


# ------------------------------------------------------------------------------------------ method fixes
def test_client_first_sampled_after_round_1_starts_from_the_current_global(ws):
    """A client that was only evaluated in round 1 (not sampled) must begin its first training from the global
    adapter it receives, not from the round-0 adapter its evaluation saw. With lr 0 training changes nothing, so
    the adapter it holds after training is exactly where it started."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from pipeline.federation import client_app
    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.protocol import encode_global, load_plan
    from pipeline.training.shared_model import initial_adapter_state

    path = write_plan("first-late", "fedselectkd", lr=0.0)
    plan = load_plan(path)
    _set_server_identity(1)
    context = Context(
        run_id=1, node_id=7, node_config={"client-name": "Academic", "plan": path}, state=RecordDict(), run_config={}
    )

    def config(rnd):
        return RecordDict({"config": ConfigRecord({"server-round": rnd, "plan": path, **CLIENT_SETTINGS})})

    evaluate = Message(config(1), dst_node_id=7, message_type="evaluate")
    evaluate.metadata.__dict__["_message_id"] = "e1"
    client_app.client_evaluate(evaluate, context)  # round 1: evaluated, never trained

    initial = initial_adapter_state(plan)
    global_2 = {k: v + 0.25 for k, v in initial.items()}  # any global different from the round-0 adapter
    train = Message(config(2), dst_node_id=7, message_type="train")
    train.content["arrays"] = encode_global(global_2, plan)
    train.metadata.__dict__["_message_id"] = "t2"
    client_app.client_train(train, context)
    held = context.state[client_app.LOCAL_STATE_KEY].to_torch_state_dict()
    for k in initial:
        assert torch.equal(held[k], global_2[k]), k


def test_sampled_late_client_is_not_resumed_as_trained_from_its_checkpoint(ws):
    """The same after a restart: an untrained client's checkpoint restores its progress but no local adapter."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from pipeline.federation import client_app
    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.protocol import load_plan

    path = write_plan("first-late-ckpt", "fedselectkd")
    plan = load_plan(path)
    _set_server_identity(1)
    node_config = {"client-name": "Committee", "plan": path}
    first = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})
    msg = Message(
        RecordDict({"config": ConfigRecord({"server-round": 1, "plan": path, **CLIENT_SETTINGS})}),
        dst_node_id=7,
        message_type="evaluate",
    )
    msg.metadata.__dict__["_message_id"] = "e1"
    client_app.client_evaluate(msg, first)
    restarted = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})
    msg.content["config"]["server-round"] = 2
    assert client_app._client_round(msg, restarted) == (plan, "Committee", 2)
    assert client_app._local_adapter(restarted) is None
    assert client_app.PROGRESS_KEY in restarted.state


def _join_history(means: list[float], late: str = "New") -> list[dict]:
    # two existing clients whose mean validation loss per round is `means`
    return [
        {"round": r, "client": c, "val_loss": m + d}
        for r, m in enumerate(means, start=1)
        for c, d in (("A", -0.5), ("B", 0.5))
    ]


@pytest.mark.parametrize(
    "means, rnd, expected",
    [
        ([10.0], 2, False),  # one round: no improvement measurable yet
        ([10.0, 9.0], 3, False),  # 10 % better: still learning
        ([10.0, 9.95], 3, True),  # 0.5 % better < 1 %: converged, joins in round 3
        ([10.0, 10.5], 3, True),  # worse: converged
        ([10.0, 9.0, 8.95], 4, True),  # (9.0 - 8.95) / 9.0 = 0.56 %
        ([10.0, 9.0, 8.0], 4, False),
        ([10.0, 9.0, 8.0], 5, True),  # max_round reached regardless
    ],
)
def test_new_client_joins_when_the_others_stop_improving(means, rnd, expected):
    from pipeline.experiments.train_config import JoinConfig
    from pipeline.federation.server_app import new_client_joins

    join = JoinConfig(min_rel_improvement=0.01, patience=1, max_round=5)
    assert new_client_joins(rnd, _join_history(means), "New", join) is expected


def test_join_patience_needs_that_many_flat_rounds():
    from pipeline.experiments.train_config import JoinConfig
    from pipeline.federation.server_app import new_client_joins

    join = JoinConfig(min_rel_improvement=0.01, patience=2, max_round=9)
    assert not new_client_joins(4, _join_history([10.0, 9.0, 8.99]), "New", join)  # only one flat round
    assert new_client_joins(5, _join_history([10.0, 9.0, 8.99, 8.98]), "New", join)
    # the late client's own rows never count
    history = _join_history([10.0, 9.99]) + [{"round": 2, "client": "New", "val_loss": 1.0}]
    assert new_client_joins(3, history, "New", JoinConfig(0.01, 1, 9))


@pytest.mark.slow
def test_post_addition_client_joins_after_convergence_and_picks_its_best_round_after_joining(ws):
    from pipeline.train import run_experiment

    # lr 0: nobody improves, so the others have converged after round 2 and SAMSum joins in round 3 (max_round 4)
    name = "post-converged"
    metrics = run_experiment(
        write_plan(
            name,
            "post_addition",
            "extreme/seed0",
            rounds=4,
            lr=0.0,
            join={"min_rel_improvement": 0.01, "patience": 1, "max_round": 4},
        ),
        track=False,
    )
    history = json.loads(Path(f"models/{name}/rounds.json").read_text())
    assert min(r["round"] for r in history if r["client"] == "SAMSum") == 3
    assert metrics["clients"]["SAMSum"]["best_round"] >= 3


@pytest.mark.timeout(30)
def test_server_stops_waiting_for_clients_that_never_connect(ws):
    # The ServerApp waits for every planned client to register; a SuperNode that never comes must end the run with
    # a clear error after the admission timeout, naming the clients missing, not keep the server (and CI) waiting.
    from flwr.app import ConfigRecord, Message, RecordDict

    from pipeline.federation.admission import AdmissionError, identify_clients
    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.protocol import load_plan

    path = write_plan("never-connect", "fedavg", rounds=1)
    identity = ConfigRecord({"client-name": "Academic", "plan-hash": load_plan(path).hash})

    class OneNodeGrid:  # only one of the three planned clients ever connects
        def get_node_ids(self):
            return [1001]

        def send_and_receive(self, messages, *, timeout=None):
            return [Message(RecordDict({"identity": identity}), reply_to=m) for m in messages]

    _set_server_identity(1)
    with pytest.raises(AdmissionError) as err:
        identify_clients(OneNodeGrid(), path, expected=["Academic", "Committee", "Product"], timeout=0.2)
    assert "['Committee', 'Product']" in str(err.value) and str(err.value).startswith(f"{path}:")
