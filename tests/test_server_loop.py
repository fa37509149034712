"""The server round loop (pipeline.federation.server_app.run_server) on a scripted federation: real Flower
messages, the real strategies, transfer encodings and checkpoints, but clients whose replies are written down in
advance (a constant update per client, a validation loss per round), so every quantity the loop computes has a
hand-computed expected value and a run takes a fraction of a second.

Properties stated: FedAvg moves the global by the |D_i|-weighted mean of the sampled clients' updates, round after
round; sampling picks round(fraction x n) clients, each about as often as the others, from (seed, round) alone;
a failed, silent or undecodable client is recorded and left out of that round's aggregate only; the late client
of the post-addition study gets no message before it is admitted and is admitted exactly when the others stop
improving (or at max_round); a gone node is recorded as absent and a restarted one takes its client's place; a
run killed after any round resumes to the uninterrupted result; every row's bytes are the encoded messages'.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# imported here, not only in the tests: mutmut's fork server imports the test modules once, so each mutant's run
# does not pay for importing Flower, transformers and the federation modules again
import pipeline.federation.engines  # noqa: F401,E402
import pipeline.federation.server_app  # noqa: F401,E402
import pipeline.training.shared_model  # noqa: F401,E402
from tests.errors import logs, names
from tests.faults import killed_after_checkpoint
from tests.test_federated import workspace, write_plan, ws  # noqa: F401  (fixtures)

N = "num-examples"
WEIGHTS = {"Academic": 1, "Committee": 2, "Product": 5, "SAMSum": 3}
DELTAS = {"Academic": 0.5, "Committee": -0.25, "Product": 0.125, "SAMSum": 1.0}  # exact in binary


@dataclass
class Script:
    """What each scripted client does: add ``delta[c]`` to every weight of the global it received, report
    ``weight[c]`` examples, ``steps[c]`` local steps and ``val(c, rnd)`` as validation loss; ``fail`` holds the
    (client, round) pairs whose training raises a DataError naming a record, ``bad_reply`` those whose reply cannot be
    decoded."""

    delta: dict[str, float] = field(default_factory=lambda: dict(DELTAS))
    weight: dict[str, int] = field(default_factory=lambda: dict(WEIGHTS))
    steps: dict[str, int] = field(default_factory=lambda: {"Academic": 1, "Committee": 2, "Product": 4, "SAMSum": 1})
    val: Callable[[str, int], float] = lambda c, rnd: 1.0 + 0.5 * rnd  # noqa: E731  (no client improves)
    fail: set = field(default_factory=set)
    fail_eval: set = field(default_factory=set)
    bad_reply: set = field(default_factory=set)
    odd_arrays: dict = field(default_factory=dict)  # (client, round) -> its reply's adapter state edited
    # (client, round) -> metrics of its train / evaluate reply to replace (None: to leave out)
    bad_metrics: dict = field(default_factory=dict)
    bad_eval_metrics: dict = field(default_factory=dict)
    more_metrics: dict = field(default_factory=dict)  # (client, round) -> metrics added to its train reply
    more_records: dict = field(default_factory=dict)  # (client, round) -> records added to its train reply
    privacy: bool = False
    # client -> the num-train / num-valid its identify reply reports (else its partition's, as client_identify's)
    counts: dict = field(default_factory=dict)
    dp_clipped: dict = field(default_factory=dict)  # client -> the client-side clipping mod's "clipped" bit
    calls: list = field(default_factory=list)  # (kind, client, round, received state or None)
    configs: list = field(default_factory=list)  # (client, round, the train message's config)
    wire: dict = field(default_factory=dict)  # (client, round) -> [bytes received, bytes sent], counted here


def _nbytes(content) -> int:
    """The adapter bytes of a message as they travel: Flower's own count of each ArrayRecord."""
    return sum(record.count_bytes() for record in content.array_records.values())


def scripted_app(script: Script):
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from pipeline.federation.protocol import decode_global, encode_reply, load_plan, plan_path_of
    from pipeline.training.client_data import read_partition

    app = ClientApp()

    def count(name, rnd, received=0, sent=0):
        wire = script.wire.setdefault((name, rnd), [0, 0])
        wire[0] += received
        wire[1] += sent

    @app.query("identify")
    def identify(msg, context):
        if context.node_config["client-name"] is None:
            raise RuntimeError("no client name configured\n(a second line)")
        plan, name = load_plan(plan_path_of(msg, context)), context.node_config["client-name"]
        identity = ConfigRecord({"client-name": name, "plan-hash": plan.hash})  # as the ClientApp's
        if name in script.counts:
            identity.update(script.counts[name])
        elif splits := read_partition(plan.paths["partition"])["clients"].get(name):
            identity.update({"num-train": len(splits["train"]), "num-valid": len(splits["valid"])})
        return Message(RecordDict({"identity": identity}), reply_to=msg)

    @app.train()
    def train(msg, context):
        plan = load_plan(plan_path_of(msg, context))
        name, rnd = context.node_config["client-name"], int(msg.content["config"]["server-round"])
        received = decode_global(msg.content["arrays"], plan)
        script.calls.append(("train", name, rnd, received))
        script.configs.append((name, rnd, dict(msg.content["config"])))
        count(name, rnd, received=_nbytes(msg.content))
        if (name, rnd) in script.fail:  # bad input: the error names the file and the record (docs/privacy.md)
            from pipeline.common.schema import DataError

            raise DataError(f"data/processed/examples.parquet: record 'ES2002a-{name}-17' has an empty source")
        local = {k: v + script.delta[name] for k, v in received.items()}
        local = script.odd_arrays.get((name, rnd), lambda state: state)(local)
        arrays = encode_reply(local, plan, received)
        if (name, rnd) in script.bad_reply:  # an int8 tensor without its scale
            arrays = ArrayRecord.from_torch_state_dict(
                {k: torch.zeros(v.shape, dtype=torch.int8) for k, v in local.items()}
            )
        metrics = {
            N: script.weight[name],
            "num-trained": script.weight[name] - 1,
            "num-steps": script.steps[name],
            "num-tokens": 10 * script.weight[name],
            "train-loss": 2.0 + rnd,
            "ce": 1.5 + rnd,
            "kd": 0.25,
            "kd-fraction": 0.5,
            "proximal": 0.125,
        }
        if script.privacy:
            metrics.update(
                {
                    "dp-epsilon": 3.0 * rnd,
                    "dp-delta": 1e-5,
                    "dp-noise-multiplier": 1.1,
                    "dp-max-grad-norm": -1.0,
                    "dp-sample-rate": 0.25,
                    "dp-steps": 4 * rnd,
                    "dp-examples": 8,
                    "dp-clipped": 2,
                }
            )
        if name in script.dp_clipped:
            metrics["dp-update-clipped"] = script.dp_clipped[name]
        metrics = _replaced(metrics, script.bad_metrics.get((name, rnd), {})) | script.more_metrics.get((name, rnd), {})
        identity = ConfigRecord({"client-name": name})  # as client_app.train_round's
        content = RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics), "identity": identity})
        for key, record in script.more_records.get((name, rnd), {}).items():
            content[key] = record
        count(name, rnd, sent=_nbytes(content))
        return Message(content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg, context):
        plan = load_plan(plan_path_of(msg, context))
        name, rnd = context.node_config["client-name"], int(msg.content["config"]["server-round"])
        sent = decode_global(msg.content["arrays"], plan) if len(msg.content.get("arrays", ArrayRecord())) else None
        script.calls.append(("evaluate", name, rnd, sent))
        count(name, rnd, received=_nbytes(msg.content))
        if (name, rnd) in script.fail_eval:
            raise RuntimeError(f"{name} cannot evaluate")
        metrics = {N: 2, "val-loss": float(script.val(name, rnd)), "val-tokens": 7, "best-round": rnd}
        metrics = _replaced(metrics, script.bad_eval_metrics.get((name, rnd), {}))
        identity = ConfigRecord({"client-name": name})
        return Message(RecordDict({"metrics": MetricRecord(metrics), "identity": identity}), reply_to=msg)

    return app


def _replaced(metrics: dict, changes: dict) -> dict:
    return {k: changes.get(k, v) for k, v in metrics.items() if changes.get(k, v) is not None}


class Grid:
    """The in-process grid of the engines with the scripted clients, and faults a real federation has: nodes that
    are gone in some rounds (``gone``: round -> client names), nodes that come back under a new id
    (``restart``: round -> client names) and replies lost on the way (``lost``: (client, round) pairs)."""

    def __init__(
        self,
        plan_path: str,
        script: Script,
        clients: list[str],
        extra: dict[int, str] | None = None,
        plan_in_node_config: bool = True,
    ):
        from pipeline.federation.engines import InProcessGrid, _set_server_identity

        self.inner = InProcessGrid(
            scripted_app(script),
            [{"client-name": c, "plan": plan_path if plan_in_node_config else ""} for c in clients],
        )
        for node, name in (extra or {}).items():  # nodes beyond the plan's clients
            from flwr.app import Context, RecordDict

            self.inner.contexts[node] = Context(
                run_id=1,
                node_id=node,
                node_config={"client-name": name, "plan": plan_path},
                state=RecordDict(),
                run_config={},
            )
        _set_server_identity(self.inner.run.run_id)
        self.gone: dict[int, set[str]] = {}
        self.restart: dict[int, set[str]] = {}
        self.rename: dict[int, dict[int, str]] = {}  # round -> {node: the client name it answers as from then on}
        self.lost: set[tuple[str, int]] = set()
        self.lost_eval: set[tuple[str, int]] = set()  # evaluation replies only
        self.silent_error: set[tuple[str, int]] = set()  # train replies turned into an error without a reason
        self.timeouts: list[tuple[str | None, float | None]] = []  # (message type, timeout) of every wait
        self.round = 0
        self.script = script

    def name(self, node: int) -> str:
        return self.inner.contexts[node].node_config["client-name"]

    # the Grid interface run_server uses
    @property
    def run(self):
        return self.inner.run

    def set_run(self, run):
        self.inner.set_run(run)

    def create_message(self, *args, **kwargs):
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self):
        return [n for n in self.inner.get_node_ids() if self.name(n) not in self.gone.get(self.round, set())]

    def push_messages(self, messages):
        return self.inner.push_messages(messages)

    def pull_messages(self, ids):
        return self.inner.pull_messages(ids)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if messages and messages[0].metadata.message_type == "train":
            self.round = int(messages[0].content["config"]["server-round"])
        self.timeouts.append((messages[0].metadata.message_type if messages else None, timeout))
        replies = self.inner.send_and_receive(messages, timeout=timeout)
        if self.silent_error:
            from flwr.app import Error, Message

            by_id = {m.metadata.message_id: m for m in messages}
            replies = [
                Message(error=Error(code=7, reason=""), reply_to=by_id[r.metadata.reply_to_message_id])
                if (self.name(r.metadata.src_node_id), self.round) in self.silent_error
                and r.metadata.message_type == "train"
                else r
                for r in replies
            ]
        lost = self.lost | (self.lost_eval if messages and messages[0].metadata.message_type == "evaluate" else set())
        return [r for r in replies if (self.name(r.metadata.src_node_id), self.round) not in lost]

    def next_round(self, rnd: int) -> None:
        """Called by the recorder before round ``rnd``: apply that round's node changes."""
        self.round = rnd
        for name in self.restart.get(rnd, set()):
            old = next(n for n in self.inner.contexts if self.name(n) == name)
            ctx = self.inner.contexts.pop(old)
            ctx.node_id = old + 100
            self.inner.contexts[old + 100] = ctx
        for node, name in self.rename.get(rnd, {}).items():  # restarted under --auth: the same node id
            self.inner.contexts[node].node_config["client-name"] = name


class Recorder:
    def __init__(self, grid: Grid | None = None):
        self.grid = grid
        self.started_with = None
        self.rounds = []
        self.round_plans = []
        self.seconds = []

    def started(self, plan, clients, start_round):
        self.started_with = (list(clients), start_round)
        self.plan = plan
        if self.grid is not None:
            self.grid.next_round(start_round)

    def round_done(self, plan, entry, history):
        self.round_plans.append(plan.experiment)
        self.seconds.append(entry.seconds)
        self.rounds.append((entry.round, [dict(r) for r in entry.rows], len(history)))
        if self.grid is not None:
            self.grid.next_round(entry.round + 1)


def run(
    plan_path: str, script: Script, clients: list[str] | None = None, grid: Grid | None = None, timeout: float = 5.0
):
    from pipeline.federation.protocol import load_plan
    from pipeline.federation.server_app import load_server_checkpoint, run_server

    clients = clients or ["Academic", "Committee", "Product"]
    grid = grid or Grid(plan_path, script, clients)
    recorder = Recorder(grid)
    ckpt = load_server_checkpoint(load_plan(plan_path))  # a killed run's: resumed
    state, history = run_server(grid, plan_path, recorder, round_timeout_s=timeout, ckpt=ckpt)
    return state, history, recorder


def initial(plan_path: str) -> dict[str, torch.Tensor]:
    from pipeline.federation.protocol import load_plan
    from pipeline.training.shared_model import initial_adapter_state

    return initial_adapter_state(load_plan(plan_path))


def logged(caplog) -> list[str]:
    """The federation log's messages (what an operator reads about the run)."""
    return [r.getMessage() for r in caplog.records if r.name == "fedmeet.federated"]


def kept_global(caplog) -> list[int]:
    """The rounds the server logged aggregating nothing (no client update: the global adapter stays as it was)."""
    return [int(m.split(":")[0].removeprefix("round ")) for m in logged(caplog) if "no client update" in m]


def rows_of(history: list[dict], rnd: int) -> dict[str, dict]:
    return {r["client"]: r for r in history if r["round"] == rnd}


def trained(script: Script, rnd: int) -> list[str]:
    return sorted(c for kind, c, r, _ in script.calls if kind == "train" and r == rnd)


def assert_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], exact: bool = True) -> None:
    assert got.keys() == expected.keys()
    for k in expected:
        if exact:
            assert torch.equal(got[k], expected[k].to(got[k].dtype)), k
        else:
            torch.testing.assert_close(got[k], expected[k].to(got[k].dtype), rtol=0, atol=1e-6)


def weighted_update(clients: list[str], script: Script) -> float:
    w = np.array([script.weight[c] for c in clients], dtype=np.float64)
    return float((w / w.sum()) @ np.array([script.delta[c] for c in clients]))


# ----------------------------------------------------------------------------------------------- aggregation
def test_fedavg_moves_the_global_by_the_weighted_mean_update_every_round(ws):
    path = write_plan("loop-fedavg", "fedavg", rounds=3, fraction_train=1.0)
    script = Script()
    import time

    t0 = time.perf_counter()
    final, history, recorder = run(path, script)
    wall = time.perf_counter() - t0
    assert len(recorder.seconds) == 3 and all(0 < s <= wall for s in recorder.seconds)  # each round's duration
    w0 = initial(path)
    step = weighted_update(["Academic", "Committee", "Product"], script)  # (0.5 - 0.5 + 0.625) / 8
    assert step == pytest.approx(0.078125)
    assert_state(final, {k: v + 3 * step for k, v in w0.items()}, exact=False)
    # each round every client received the previous round's global, exactly (fp32 on the wire)
    for rnd in (1, 2, 3):
        got = [s for kind, _, r, s in script.calls if kind == "train" and r == rnd]
        assert len(got) == 3
        for s in got:
            assert_state(s, {k: v + (rnd - 1) * step for k, v in w0.items()}, exact=False)
    rows = rows_of(history, 2)
    total = sum(WEIGHTS[c] for c in rows)
    for c, row in rows.items():
        assert (row["sampled"], row["failed"], row["weight"]) == (1, 0, WEIGHTS[c])
        assert row["weight_share"] == pytest.approx(WEIGHTS[c] / total)
        assert (row["n_examples"], row["n_steps"], row["n_tokens"]) == (
            WEIGHTS[c] - 1,
            script.steps[c],
            10 * WEIGHTS[c],
        )
        assert (row["train_loss"], row["ce"], row["kd"], row["kd_fraction"], row["proximal"]) == (
            4.0,
            3.5,
            0.25,
            0.5,
            0.125,
        )
        assert (row["val_loss"], row["val_tokens"], row["best_round"]) == (2.0, 7, 2)
        assert "epsilon" not in row and "absent" not in row and "error" not in row
    assert recorder.started_with == (["Academic", "Committee", "Product"], 1)
    assert recorder.plan.experiment == "loop-fedavg"  # the recorder is told whose run started and ended rounds
    assert recorder.round_plans == ["loop-fedavg"] * 3
    assert [(r, n) for r, _, n in recorder.rounds] == [(1, 3), (2, 6), (3, 9)]
    assert [r["round"] for r in history] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [r["client"] for r in history[:3]] == ["Academic", "Committee", "Product"]  # sorted by client


def test_fednova_on_the_loop_normalises_by_each_clients_steps(ws):
    """tau = (1, 2, 4), p = (1, 2, 5)/8, update per client d_c: W_new = W - tau_eff sum p_c (-d_c) / tau_c."""
    path = write_plan("loop-fednova", "fednova", rounds=1, fraction_train=1.0)
    script = Script()
    final, _, _ = run(path, script)
    p = {c: WEIGHTS[c] / 8 for c in ("Academic", "Committee", "Product")}
    tau_eff = sum(p[c] * script.steps[c] for c in p)
    move = tau_eff * sum(p[c] * DELTAS[c] / script.steps[c] for c in p)
    assert_state(final, {k: v + move for k, v in initial(path).items()}, exact=False)


def test_fedprox_sends_every_sampled_client_the_plans_mu(ws):
    path = write_plan("loop-fedprox", "fedprox", rounds=2, fraction_train=0.67, proximal_mu=0.375)
    script = Script()
    run(path, script)
    assert len(script.configs) == 4  # 2 of 3 clients per round
    assert all(cfg["proximal-mu"] == 0.375 for _, _, cfg in script.configs), script.configs


def test_clients_configured_without_a_plan_follow_the_plan_each_message_names(ws):
    """A SuperNode started without a plan in its node config reads it from the train and evaluation messages."""
    path = write_plan("loop-plan-in-message", "fedavg", rounds=2, fraction_train=1.0)
    script = Script()
    grid = Grid(path, script, ["Academic", "Committee", "Product"], plan_in_node_config=False)
    final, history, _ = run(path, script, grid=grid)
    assert all(r["failed"] == 0 and "eval_failed" not in r and "val_loss" in r for r in history)
    assert_state(
        final,
        {k: v + 2 * weighted_update(["Academic", "Committee", "Product"], script) for k, v in initial(path).items()},
        exact=False,
    )


def test_eval_messages_carry_the_global_only_for_methods_that_evaluate_it(ws):
    """AdaFedAvg evaluates the new global itself: the evaluation message carries it (a second download); the KD
    methods evaluate the client's own adapter: nothing is sent with the evaluation."""
    avg = Script()
    _, h_avg, _ = run(write_plan("loop-evalsend", "fedavg", rounds=1, fraction_train=1.0), avg)
    kd = Script()
    _, h_kd, _ = run(write_plan("loop-evalnone", "fedkd", rounds=1, fraction_train=1.0), kd)
    evals_avg = [s for kind, _, _, s in avg.calls if kind == "evaluate"]
    evals_kd = [s for kind, _, _, s in kd.calls if kind == "evaluate"]
    assert len(evals_avg) == len(evals_kd) == 3
    assert all(s is None for s in evals_kd)
    w1 = {
        k: v + weighted_update(["Academic", "Committee", "Product"], avg)
        for k, v in initial("models/plans/loop-evalsend.json").items()
    }
    for s in evals_avg:
        assert_state(s, w1, exact=False)  # the aggregate of this round
    for row in rows_of(h_avg, 1).values():
        assert row["bytes_up"] > 0 and row["bytes_down"] == 2 * row["bytes_up"]  # fp32: train + eval copy
    for row in rows_of(h_kd, 1).values():
        assert row["bytes_down"] == row["bytes_up"] > 0


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_bytes_are_those_the_clients_received_and_sent(ws, dtype):
    """bytes_down / bytes_up of a row = the adapter bytes the client got (train and evaluation messages) and sent
    that round, counted on the client's side; int8 sends a quarter of the tensor bytes of fp32."""
    script = Script()
    _, history, _ = run(
        write_plan(f"loop-bytes-{dtype}", "fedavg", rounds=2, fraction_train=0.67, transfer_dtype=dtype), script
    )
    for row in history:
        assert [row["bytes_down"], row["bytes_up"]] == script.wire[(row["client"], row["round"])]
    n = sum(v.numel() for v in initial(f"models/plans/loop-bytes-{dtype}.json").values())
    sent = [row["bytes_up"] for row in history if row["sampled"]]
    assert all(b >= (4 if dtype == "fp32" else 1) * n for b in sent)
    if dtype == "int8":
        assert all(b < 4 * n for b in sent)


def test_a_delta_encoded_reply_is_added_back_to_the_global_the_client_received(ws):
    """int8 with train.transfer_delta: clients send W_c - W_received, the server adds it back to what it sent, so
    FedAvg still moves the global by the weighted mean update (a constant delta quantises exactly)."""
    path = write_plan("loop-delta", "fedavg", rounds=2, fraction_train=1.0, transfer_dtype="int8", transfer_delta=True)
    script = Script()
    final, history, _ = run(path, script)
    step = weighted_update(["Academic", "Committee", "Product"], script)
    assert_state(final, {k: v + 2 * step for k, v in initial(path).items()}, exact=False)
    assert all(r["failed"] == 0 for r in history)
    # what the clients evaluate (FedAvg evaluates the global) is each round's aggregate, decoded like the train copy
    for rnd in (1, 2):
        evaluated = [st for kind, _, r, st in script.calls if kind == "evaluate" and r == rnd]
        assert len(evaluated) == 3
        for got in evaluated:
            assert_state(got, {k: v + rnd * step for k, v in initial(path).items()}, exact=False)


def test_every_wait_on_the_clients_is_bounded_by_the_round_timeout(ws):
    """Identification (at the start and of a restarted node), training and evaluation replies are all awaited at
    most round_timeout_s."""
    grid_path = write_plan("loop-timeouts", "fedavg", rounds=2, fraction_train=1.0)
    script = Script()
    grid = Grid(grid_path, script, ["Academic", "Committee", "Product"])
    grid.restart = {2: {"Product"}}  # a new node id in round 2: identified again
    run(grid_path, script, grid=grid, timeout=3.5)
    kinds = [k for k, _ in grid.timeouts]
    assert kinds.count("train") == 2 and kinds.count("evaluate") == 2 and kinds.count("query.identify") == 2
    assert all(t == 3.5 for _, t in grid.timeouts), grid.timeouts
    # without a round timeout the server waits the run-time setting's default: a hung node costs minutes, not a day
    from pipeline.experiments.settings import RunSettings
    from pipeline.federation.server_app import run_server

    path = write_plan("loop-timeouts-default", "fedavg", rounds=1, fraction_train=1.0)
    grid = Grid(path, Script(), ["Academic", "Committee", "Product"])
    run_server(grid, path, Recorder(grid), ckpt=None)
    default = RunSettings().round_timeout_s
    assert default <= 3600 and grid.timeouts and all(t == default for _, t in grid.timeouts), grid.timeouts


def test_a_failure_without_a_reason_is_recorded_by_its_error_code(ws, caplog):
    path = write_plan("loop-silent", "fedavg", rounds=1, fraction_train=1.0)
    script = Script()
    grid = Grid(path, script, ["Academic", "Committee", "Product"])
    grid.silent_error = {("Committee", 1)}
    final, history, _ = run(path, script, grid=grid)
    row = rows_of(history, 1)["Committee"]
    assert (row["failed"], row["error"]) == (1, "code 7") and "weight" not in row
    step = weighted_update(["Academic", "Product"], script)  # the others' aggregate only
    assert_state(final, {k: v + step for k, v in initial(path).items()}, exact=False)


def _client_dp(path: str, mode: str = "client", **privacy) -> str:
    from pipeline.common.config import from_dict
    from pipeline.experiments.privacy import PrivacyConfig

    plan = json.loads(Path(path).read_text())
    plan["privacy"] = from_dict(
        PrivacyConfig, {"mode": mode, "noise_multiplier": 0.0, **privacy}, "privacy"
    ).plan_dict()
    Path(path).write_text(json.dumps(plan, indent=2, sort_keys=True))
    return path


def test_client_side_clipping_leaves_out_a_reply_without_the_mods_mark_and_averages_the_rest_uniformly(ws, caplog):
    """Client-level DP, client-side clipping, noise 0: a reply without the clipping mod's bit is not aggregated
    (failed, logged); the others enter a uniform mean (not |D_i|-weighted) and their rows get their bit, the norm
    of their update (|delta_c| sqrt(n)) and C."""
    path = _client_dp(
        write_plan("loop-cdp-client", "fedavg", rounds=1, fraction_train=1.0), clipping_norm=1e6, clipping_side="client"
    )
    script = Script(dp_clipped={"Academic": 1, "Committee": 0})  # Product: a client without the mod
    with caplog.at_level(logging.WARNING, logger="fedmeet.federated"):
        final, history, _ = run(path, script)
    rows = rows_of(history, 1)
    n = sum(v.numel() for v in initial(path).values())
    assert rows["Product"]["failed"] == 1 and "update_clipped" not in rows["Product"]
    logs(logged(caplog), "round 1", "Product", "C=1e+06")
    for c, bit in (("Academic", 1), ("Committee", 0)):
        assert rows[c]["failed"] == 0 and rows[c]["update_clipped"] == bit and rows[c]["clipping_norm"] == 1e6
        assert rows[c]["update_norm"] == pytest.approx(abs(DELTAS[c]) * n**0.5, rel=1e-5)
        assert rows[c]["weight_share"] == pytest.approx(1 / 3)  # 1 / the expected count, whoever replied
    uniform = (DELTAS["Academic"] + DELTAS["Committee"]) / 3  # the sum over the expected count (3 of 3)
    assert_state(final, {k: v + uniform for k, v in initial(path).items()}, exact=False)


@pytest.mark.parametrize("value", [0.7, 2])
@pytest.mark.parametrize("clipping, mark", [("fixed", "dp-update-clipped"), ("adaptive", "norm_bit")])
def test_a_clipping_mark_other_than_0_or_1_is_its_clients_malformed_reply(ws, caplog, clipping, mark, value):
    """Client-side clipping: Flower's adaptiveclipping_mod sends norm_bit as int(norm_bit), client_dp_mod
    dp-update-clipped as int(norm > C): 0 or 1. Product's mark 0.7 (or 2) was read by int() (update_clipped 0, or 2)
    and bool() (one more clipped client, moving adaptive C). It is Product's malformed reply: left out, its row and log
    line name the mark; adaptive C moves by the others' bits only: C exp(lr (1/3 - q)), Academic's 1 of the
    expected 3."""
    import math

    adaptive = {"clipped_count_stddev": 0.0} if clipping == "adaptive" else {}
    name = f"loop-cdp-mark-{clipping}-{value}".replace(".", "")
    path = write_plan(name, "fedavg", rounds=2, fraction_train=1.0)
    _client_dp(path, clipping_norm=1e6, clipping_side="client", clipping=clipping, **adaptive)
    bits = {"Academic": 1, "Committee": 0, "Product": value}
    if clipping == "fixed":
        script = Script(dp_clipped=bits)
    else:
        more = {(c, rnd): {"norm_bit": bit} for c, bit in bits.items() for rnd in (1, 2)}
        script = Script(dp_clipped={c: 0 for c in bits}, more_metrics=more)
    with caplog.at_level(logging.WARNING, logger="fedmeet.federated"):
        _, history, _ = run(path, script)
    rows = rows_of(history, 1)
    assert rows["Product"]["failed"] == 1 and f"{mark!r}: {value}" in rows["Product"]["error"]
    assert "update_clipped" not in rows["Product"] and [rows[c]["failed"] for c in ("Academic", "Committee")] == [0, 0]
    logs(logged(caplog), "round 1", "Product", f"{mark!r}: {value}")
    if clipping == "adaptive":  # PrivacyConfig's defaults: clip_norm_lr 0.2, target_clipped_quantile 0.5
        assert rows_of(history, 2)["Academic"]["clipping_norm"] == pytest.approx(1e6 * math.exp(0.2 * (1 / 3 - 0.5)))


def test_client_level_dp_a_round_with_every_node_gone_keeps_the_global_of_the_round_before(ws):
    """Client-level DP (noise 0, C above every update), every SuperNode gone in round 2: nothing is aggregated, so
    round 2 releases the global it started from, W1 = W0 + the uniform mean of round 1 (plus the noise, 0 here), not
    round 1's starting global W0; round 3 moves it again: W0 + 2 x (sum of the deltas) / 3 by hand."""
    path = _client_dp(write_plan("loop-cdp-all-gone", "fedavg", rounds=3, fraction_train=1.0), clipping_norm=1e6)
    script = Script()
    grid = Grid(path, script, ["Academic", "Committee", "Product"])
    grid.gone = {2: {"Academic", "Committee", "Product"}}
    final, history, _ = run(path, script, grid=grid)
    assert trained(script, 2) == [] and trained(script, 3) == ["Academic", "Committee", "Product"]
    uniform = (DELTAS["Academic"] + DELTAS["Committee"] + DELTAS["Product"]) / 3  # the sum over the expected 3
    assert_state(final, {k: v + 2 * uniform for k, v in initial(path).items()}, exact=False)


def test_server_side_clipping_marks_the_updates_above_c_and_aggregates_every_reply(ws):
    """Server-side clipping at C between the updates' norms: the update above C is marked clipped, the others not;
    every reply is aggregated (the wrapper clips), uniformly."""
    path = write_plan("loop-cdp-server", "fedavg", rounds=1, fraction_train=1.0)
    n = sum(v.numel() for v in initial(path).values())
    c = 0.3 * n**0.5  # Academic's update (0.5 sqrt(n)) is above C, Committee's (0.25) and Product's (0.125) below
    _client_dp(path, clipping_norm=c, clipping_side="server")
    script = Script()
    _, history, _ = run(path, script)
    rows = rows_of(history, 1)
    assert {k: r["update_clipped"] for k, r in rows.items()} == {"Academic": 1, "Committee": 0, "Product": 0}
    assert all(r["failed"] == 0 and r["weight_share"] == pytest.approx(1 / 3) for r in rows.values())
    assert rows["Academic"]["update_norm"] == pytest.approx(0.5 * n**0.5, rel=1e-5)


# ----------------------------------------------------------------------------------------------- sampling
def test_sampling_picks_the_fraction_of_clients_each_as_often_and_every_client_evaluates(ws):
    rounds = 30
    path = write_plan("loop-sampling", "fedavg", rounds=rounds, fraction_train=0.67)
    script = Script(delta={c: 0.0 for c in DELTAS})  # the global stays put: only who is sampled matters
    _, history, _ = run(path, script)
    counts = {c: 0 for c in ("Academic", "Committee", "Product")}
    for rnd in range(1, rounds + 1):
        rows = rows_of(history, rnd)
        picked = trained(script, rnd)
        assert len(picked) == 2  # int(0.67 * 3)
        assert sorted(c for c, r in rows.items() if r["sampled"]) == picked
        assert len(rows) == 3 and all("val_loss" in r for r in rows.values())  # all evaluate
        for c, r in rows.items():
            assert (r["bytes_up"] > 0) == (c in picked) and r["failed"] == 0
            if c not in picked:
                assert r["bytes_down"] > 0  # only the evaluation copy of the global
        for c in picked:
            counts[c] += 1
    # each client sampled with probability 2/3: Binomial(30, 2/3) has mean 20 and sd 2.6; +-3 sd
    assert all(12 <= n <= 28 for n in counts.values()), counts
    # and the sampling differs from round to round
    assert len({tuple(trained(script, r)) for r in range(1, rounds + 1)}) == 3


def test_sampling_is_a_function_of_the_seed_and_the_round(ws):
    def sample(name, seed_offset_rounds, seed=0):
        path = write_plan(name, "fedavg", rounds=8, fraction_train=0.34)
        plan = json.loads(Path(path).read_text())
        plan["seed"] = seed
        Path(path).write_text(json.dumps(plan, indent=2, sort_keys=True))
        script = Script(delta={c: 0.0 for c in DELTAS})
        import random

        random.seed(seed_offset_rounds)  # whatever the process's RNG held before
        run(path, script)
        return [tuple(trained(script, r)) for r in range(1, 9)]

    a, b = sample("loop-seed-a", 1), sample("loop-seed-b", 2)
    assert a == b and all(len(s) == 1 for s in a)
    # another experiment seed, another sequence (8 rounds of 1 of 3 clients: 3^8 possible sequences)
    other = sample("loop-seed-c", 1, seed=1)
    assert other != a and all(len(s) == 1 for s in other)


def test_sampling_does_not_depend_on_the_node_ids(ws):
    """A SuperLink gives its nodes random ids (new ones after a restart): the same plan samples the same clients
    in the same rounds whatever ids its nodes have, here the engine's in reverse order of the clients'."""

    def sample(name, renumber):
        path = write_plan(name, "fedavg", rounds=8, fraction_train=0.34)
        script = Script(delta={c: 0.0 for c in DELTAS})
        grid = Grid(path, script, ["Academic", "Committee", "Product"])
        if renumber:
            contexts = grid.inner.contexts
            grid.inner.contexts = {2002 - n: contexts[n] for n in sorted(contexts)}
            for node, ctx in grid.inner.contexts.items():
                ctx.node_id = node
        run(path, script, grid=grid)
        return [trained(script, r) for r in range(1, 9)]

    assert sample("loop-ids-a", renumber=False) == sample("loop-ids-b", renumber=True)


def test_a_run_killed_after_any_round_resumes_to_the_uninterrupted_result(ws, monkeypatch, caplog):
    """Killed after any round's checkpoint, the rerun samples, aggregates and records exactly as the run that was
    never killed: the checkpoint holds the global, the server optimiser's moments, the RNG and the history."""
    kwargs = dict(rounds=4, fraction_train=0.67, fedopt={"server_optimizer": "adam", "server_lr": 0.1})
    full_script = Script()
    full, full_history, _ = run(write_plan("loop-uninterrupted", "fedopt", **kwargs), full_script)
    for kill_after in (1, 3):
        path = write_plan(f"loop-killed{kill_after}", "fedopt", **kwargs)
        script = Script()
        with killed_after_checkpoint(monkeypatch, kill_after):
            run(path, script)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
            resumed, history, recorder = run(path, script)
        assert f"loop-killed{kill_after}: resuming after round {kill_after}" in logged(caplog)
        assert recorder.started_with[1] == kill_after + 1  # resumed, not restarted
        assert_state(resumed, full)
        assert history == full_history
        assert [(c, r) for k, c, r, _ in script.calls if k == "train"] == [
            (c, r) for k, c, r, _ in full_script.calls if k == "train"
        ]


def test_a_checkpoint_of_another_configuration_is_not_resumed(ws, monkeypatch):
    path = write_plan("loop-otherplan", "fedavg", rounds=2, fraction_train=1.0)
    with killed_after_checkpoint(monkeypatch, 1):
        run(path, Script())
    path = write_plan("loop-otherplan", "fedavg", rounds=2, fraction_train=1.0, lr=0.5)  # same name, new plan
    _, history, recorder = run(path, Script())
    assert recorder.started_with[1] == 1 and [r["round"] for r in history] == [1, 1, 1, 2, 2, 2]


# ----------------------------------------------------------------------------------------------- failures
def test_a_failed_client_is_left_out_of_that_rounds_aggregate_only(ws, caplog):
    path = write_plan("loop-fail", "fedavg", rounds=2, fraction_train=1.0)
    script = Script(fail={("Committee", 1)})
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        final, history, recorder = run(path, script)
    r1 = rows_of(history, 1)
    assert r1["Committee"]["failed"] == 1
    # docs/privacy.md: the server learns the exception's class, the client, the message type and round only; the
    # text, naming the file and the record, is in the client's log (with its traceback), not in the run's records
    names(r1["Committee"]["error"], "DataError", "Committee", "train", "round 1", "client's log")
    server = [r.getMessage() for r in caplog.records if r.name == "fedmeet.federated" and r.module != "client_app"]
    logs(server, "round 1", "Committee", "DataError")
    assert not [t for t in [json.dumps(history), *server] if "ES2002a" in t or "examples.parquet" in t]
    client = [r for r in caplog.records if r.module == "client_app" and r.levelno == logging.ERROR and r.exc_info]
    logs([r.getMessage() for r in client], "Committee", "DataError", "examples.parquet", "'ES2002a-Committee-17'")
    assert r1["Committee"]["bytes_up"] == 0 and r1["Committee"]["sampled"] == 1  # sampled, sent nothing back
    assert "weight" not in r1["Committee"] and "weight_share" not in r1["Committee"]
    assert r1["Academic"]["weight_share"] == pytest.approx(1 / 6) and r1["Product"]["weight_share"] == pytest.approx(
        5 / 6
    )
    assert rows_of(history, 2)["Committee"]["failed"] == 0
    step1 = weighted_update(["Academic", "Product"], script)
    step2 = weighted_update(["Academic", "Committee", "Product"], script)
    assert_state(final, {k: v + step1 + step2 for k, v in initial(path).items()}, exact=False)
    assert kept_global(caplog) == []


def test_a_round_without_any_update_keeps_the_global(ws, caplog):
    path = write_plan("loop-allfail", "fedavg", rounds=2, fraction_train=1.0)
    script = Script(fail={(c, 1) for c in WEIGHTS})
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        final, history, recorder = run(path, script)
    assert "round 1: no client update; the global adapter stays as it was" in logged(caplog)
    assert "round 2: no client update; the global adapter stays as it was" not in logged(caplog)
    assert kept_global(caplog) == [1]
    assert {c: r["failed"] for c, r in rows_of(history, 1).items()} == dict.fromkeys(
        ["Academic", "Committee", "Product"], 1
    )
    # round 2 started from the round-0 adapter
    assert_state(
        final,
        {k: v + weighted_update(["Academic", "Committee", "Product"], script) for k, v in initial(path).items()},
        exact=False,
    )


def test_a_reply_lost_on_the_way_counts_as_failed_with_the_timeout(ws, caplog):
    path = write_plan("loop-lost", "fedavg", rounds=1, fraction_train=1.0)
    script = Script()
    grid = Grid(path, script, ["Academic", "Committee", "Product"])
    grid.lost = {("Product", 1)}
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        final, history, _ = run(path, script, grid=grid, timeout=7)
    logs(logged(caplog), "round 1", "Product")
    row = rows_of(history, 1)["Product"]
    assert row["failed"] == 1 and row["error"] == "no reply within 7s (train.round_timeout_s)"
    assert "val_loss" not in row  # its evaluation reply was lost too
    assert_state(
        final,
        {k: v + weighted_update(["Academic", "Committee"], script) for k, v in initial(path).items()},
        exact=False,
    )


def test_an_undecodable_reply_is_left_out_and_recorded(ws, caplog):
    path = write_plan("loop-undecodable", "fedavg", rounds=1, fraction_train=1.0)
    script = Script(bad_reply={("Academic", 1)})
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        final, history, _ = run(path, script)
    logs(logged(caplog), "round 1", "Academic", "int8")
    rows = rows_of(history, 1)
    assert rows["Academic"]["failed"] == 1 and "weight_share" not in rows["Academic"]
    assert rows["Academic"]["error"].startswith("it cannot be decoded: ") and "int8" in rows["Academic"]["error"]
    assert rows["Academic"]["bytes_up"] > 0  # it did arrive
    assert rows["Committee"]["weight_share"] == pytest.approx(2 / 7)
    assert_state(
        final, {k: v + weighted_update(["Committee", "Product"], script) for k, v in initial(path).items()}, exact=False
    )


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_a_reply_whose_arrays_are_not_the_adapters_is_left_out_not_the_servers_end(ws, caplog, dtype):
    """A reply with an array the adapter lacks, or one of another shape: its client's failure for the round (one log
    line naming the array); before, Flower's aggregate raised InconsistentMessageReplies (other keys than the other
    replies') or NumPy/torch a broadcasting error (another shape) and ended the run."""
    path = write_plan(f"loop-odd-arrays-{dtype}", "fedavg", rounds=1, fraction_train=1.0, transfer_dtype=dtype)
    extra = lambda state: state | {"extra.weight": torch.zeros(2)}  # noqa: E731
    reshaped = lambda state: {k: v[:1] if k == min(state) else v for k, v in state.items()}  # noqa: E731
    script = Script(odd_arrays={("Academic", 1): extra, ("Committee", 1): reshaped})
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        final, history, _ = run(path, script)
    rows = rows_of(history, 1)
    assert [c for c in rows if rows[c]["failed"]] == ["Academic", "Committee"]
    assert "extra.weight" in rows["Academic"]["error"] and min(initial(path)) in rows["Committee"]["error"]
    logs(logged(caplog), "round 1", "Academic", "extra.weight")
    assert rows["Product"]["weight_share"] == 1.0
    if dtype == "fp32":  # int8: Product's reply as quantised
        assert_state(final, {k: v + DELTAS["Product"] for k, v in initial(path).items()}, exact=False)


def test_a_reply_holding_nan_weights_is_left_out_not_averaged_into_the_global(ws, caplog):
    """A reply whose fp32 arrays hold a NaN (no client's encode_state sends one): that client's failure for the
    round, named in one log line; the others' mean is the global. Before, FedAvg averaged it in and round 2's
    encode_global raised a ValueError naming no client, ending the server's run."""
    from flwr.app import ArrayRecord

    path = write_plan("loop-nan-reply", "fedavg", rounds=2, fraction_train=1.0)
    nan = ArrayRecord.from_torch_state_dict({k: torch.full(v.shape, float("nan")) for k, v in initial(path).items()})
    script = Script(more_records={("Academic", 1): {"arrays": nan}})
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        final, history, _ = run(path, script)
    r1 = rows_of(history, 1)
    assert [c for c in r1 if r1[c]["failed"]] == ["Academic"] and "NaN or inf" in r1["Academic"]["error"]
    logs(logged(caplog), "round 1", "Academic", "NaN or inf")
    move = weighted_update(["Committee", "Product"], script) + weighted_update(list(DELTAS)[:3], script)
    assert_state(final, {k: v + move for k, v in initial(path).items()}, exact=False)


def test_every_other_reply_of_a_round_with_an_undecodable_one_is_aggregated(ws):
    """Whatever the order the replies arrive in: a different client's reply is undecodable in each of 3 rounds;
    each round aggregates exactly the other two."""
    path = write_plan("loop-undecodable3", "fedavg", rounds=3, fraction_train=1.0)
    bad = {1: "Academic", 2: "Committee", 3: "Product"}
    script = Script(bad_reply={(c, r) for r, c in bad.items()})
    final, history, _ = run(path, script)
    clients = ["Academic", "Committee", "Product"]
    for rnd, c in bad.items():
        rows = rows_of(history, rnd)
        assert [n for n in clients if rows[n]["failed"]] == [c]
        assert all("weight_share" in rows[n] for n in clients if n != c)
    move = sum(weighted_update([n for n in clients if n != c], script) for c in bad.values())
    assert_state(final, {k: v + move for k, v in initial(path).items()}, exact=False)


def test_a_reply_with_malformed_metrics_is_that_clients_failure_not_the_servers(ws, caplog):
    """A train reply lacking a standard metric or holding a list where one number goes, an evaluation reply lacking
    its validation loss: each is its client's failure for the round (one log line naming it and the problem), as an
    undecodable reply is; the round aggregates the others (KeyError/TypeError ended the whole run before)."""
    path = write_plan("loop-bad-metrics", "fedkd", rounds=2, fraction_train=1.0)
    script = Script(
        bad_metrics={("Academic", 1): {"num-steps": None}, ("Committee", 1): {"ce": [1.0, 2.0]}},
        bad_eval_metrics={("Product", 2): {"val-loss": None}},
    )
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        final, history, recorder = run(path, script)
    r1, r2 = rows_of(history, 1), rows_of(history, 2)
    assert [c for c in r1 if r1[c]["failed"]] == ["Academic", "Committee"] and "weight_share" not in r1["Academic"]
    assert "num-steps" in r1["Academic"]["error"] and "ce" in r1["Committee"]["error"]
    assert r1["Product"]["weight_share"] == 1.0 and kept_global(caplog) == []
    logs(logged(caplog), "round 1", "Academic", "num-steps")
    logs(logged(caplog), "round 1", "Committee", "'ce'")
    assert r2["Product"]["eval_failed"] == 1 and "val_loss" not in r2["Product"] and r2["Product"]["failed"] == 0
    logs(logged(caplog), "round 2", "Product", "val-loss")
    assert r2["Academic"]["val_loss"] == 2.0 and "eval_failed" not in r2["Academic"]
    # round 1 moved the global by Product's update alone, round 2 by the three clients' weighted mean
    step = DELTAS["Product"] + weighted_update(["Academic", "Committee", "Product"], script)
    assert_state(final, {k: v + step for k, v in initial(path).items()}, exact=False)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_diverged_clients_non_finite_val_loss_is_recorded_as_its_report(ws, value):
    """A client whose training diverged reports a NaN or inf validation loss: its honest report, recorded as its
    val_loss (the round's mean is then NaN or inf, never a best round: training.stopping), not a failed evaluation,
    which would carry its last finite loss forward and hide the divergence; round 2 goes on with every client."""
    path = write_plan(f"loop-val-{value}", "fedkd", rounds=2, fraction_train=1.0)
    script = Script(bad_eval_metrics={("Product", 1): {"val-loss": value}})
    _, history, _ = run(path, script)
    r1, r2 = rows_of(history, 1), rows_of(history, 2)
    assert r1["Product"].get("eval_failed", 0) == 0 and np.isnan(r1["Product"]["val_loss"]) == np.isnan(value)
    assert r1["Product"]["val_loss"] == value or np.isnan(value)
    assert r1["Academic"]["val_loss"] == 1.5 and [r2[c]["val_loss"] for c in sorted(r2)] == [2.0, 2.0, 2.0]
    assert trained(script, 2) == ["Academic", "Committee", "Product"]


@pytest.mark.parametrize(
    "key", ["num-trained", "num-tokens", "dp-steps", "dp-examples", "dp-clipped", "val-tokens", "best-round"]
)
def test_a_negative_count_in_a_reply_is_that_clients_failure(ws, caplog, key):
    """Example-level DP (noise 0): Committee's train reply (or its evaluate reply) holds -1 for a count (examples,
    tokens, steps, clipped examples, the round of its best adapter): before, taken as one whole number (its row's
    count -1, a negative clipped fraction), the update aggregated; now a malformed reply, as a count that is no whole
    number: its failure (its evaluation's), one log line naming the key. The global moves by numpy's weighted mean of
    the updates of the clients whose train replies are well-formed."""
    path = _client_dp(write_plan(f"loop-negative-{key}", "fedavg", rounds=1, fraction_train=1.0), mode="example")
    evaluate = key in ("val-tokens", "best-round")
    bad = {("Committee", 1): {key: -1}}
    script = Script(privacy=True, bad_eval_metrics=bad) if evaluate else Script(privacy=True, bad_metrics=bad)
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        final, history, _ = run(path, script)
    row = rows_of(history, 1)["Committee"]
    logs(logged(caplog), "round 1", "Committee", f"{key!r}: -1")
    if evaluate:
        assert (row["eval_failed"], row["failed"]) == (1, 0) and "val_loss" not in row and row["n_tokens"] == 20
    else:
        assert row["failed"] == 1 and "weight_share" not in row and "n_tokens" not in row
    clients = ["Academic", "Committee", "Product"] if evaluate else ["Academic", "Product"]
    step = np.average([DELTAS[c] for c in clients], weights=[WEIGHTS[c] for c in clients])
    assert_state(final, {k: v + step for k, v in initial(path).items()}, exact=False)


def test_a_reply_with_other_metric_keys_or_records_than_the_plans_is_that_clients_failure(ws, caplog):
    """Flower's FedAvg aggregates a round only if its replies hold one ArrayRecord and one MetricRecord with the same
    keys (else InconsistentMessageReplies ended the run): a reply with a key the plan's replies lack (an extra one,
    the DP-SGD report under a plan without example-level DP) or a second record is its client's failure (one log
    line naming it); round 1 and round 2 move the global by Product's update alone, by hand."""
    from flwr.app import ArrayRecord, MetricRecord

    path = write_plan("loop-odd-keys", "fedavg", rounds=2, fraction_train=1.0)
    dp = {"dp-epsilon": 1.0, "dp-delta": 1e-5, "dp-noise-multiplier": 1.0, "dp-max-grad-norm": 1.0}
    dp |= {"dp-sample-rate": 0.5, "dp-steps": 2, "dp-examples": 4, "dp-clipped": 0}
    script = Script(
        more_metrics={("Academic", 1): {"extra": 1.0}, ("Committee", 1): dp},
        more_records={("Academic", 2): {"more": MetricRecord({"x": 1.0})}, ("Committee", 2): {"more": ArrayRecord()}},
    )
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        final, history, recorder = run(path, script)
    r1, r2 = rows_of(history, 1), rows_of(history, 2)
    for rows in (r1, r2):
        assert [c for c in rows if rows[c]["failed"]] == ["Academic", "Committee"]
        assert rows["Product"]["weight_share"] == 1
    assert "'extra'" in r1["Academic"]["error"] and "dp-epsilon" in r1["Committee"]["error"]
    assert "epsilon" not in r1["Committee"] and "more" in r2["Academic"]["error"] and "more" in r2["Committee"]["error"]
    logs(logged(caplog), "round 1", "Academic", "extra")
    logs(logged(caplog), "round 2", "Committee", "more")
    assert kept_global(caplog) == []
    assert_state(final, {k: v + 2 * DELTAS["Product"] for k, v in initial(path).items()}, exact=False)


def test_a_run_none_of_whose_clients_ever_trained_fails_naming_the_first_failure(ws, caplog):
    """Every sampled client failed in every round: nothing was trained, so the run is an error (one line, exit 2 at
    the stage) naming the first failure, not a finished run whose adapters are the initial ones (it exited 0)."""
    from pipeline.federation.processes import FederationError

    path = write_plan("loop-neverfail", "fedavg", rounds=2, fraction_train=1.0)
    script = Script(fail={(c, rnd) for c in WEIGHTS for rnd in (1, 2)})
    with pytest.raises(FederationError, match=r"loop-neverfail: no client update in any round") as err:
        run(path, script)
    names(str(err.value), "Academic in round 1", "DataError")
    # one round trained by one client is a run: it finishes
    path = write_plan("loop-onefail", "fedavg", rounds=2, fraction_train=1.0)
    script = Script(fail={(c, rnd) for c in WEIGHTS for rnd in (1, 2)} - {("Product", 2)})
    final, history, _ = run(path, script)
    assert [r["client"] for r in history if not r["failed"]] == ["Product"]


def test_a_reply_that_trained_nothing_is_that_clients_failure_not_fednovas_or_a_division_by_zero(ws, caplog):
    """num-steps 0 (FedNova raised ValueError: it divides by each client's steps) and, in round 2, num-examples 0 in
    every reply (Flower's metric aggregation, FedAvg's and FedNova's, divides by the weights' sum: ZeroDivisionError,
    as the weight shares would): each such reply is its client's failure (a genuine client trains at least one
    example in one step; one with an empty train split cannot identify). By hand: round 1 is FedNova of Committee
    and Product, round 2 keeps it."""
    path = write_plan("loop-trained-nothing", "fednova", rounds=2, fraction_train=1.0)
    nothing = {("Academic", 1): {"num-steps": 0}} | {(c, 2): {N: 0} for c in ("Academic", "Committee", "Product")}
    script = Script(bad_metrics=nothing)
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        final, history, recorder = run(path, script)
    r1, r2 = rows_of(history, 1), rows_of(history, 2)
    assert [c for c in r1 if r1[c]["failed"]] == ["Academic"] and "num-steps 0" in r1["Academic"]["error"]
    assert all(r2[c]["failed"] and "num-examples 0" in r2[c]["error"] for c in r2)
    logs(logged(caplog), "round 1", "Academic", "no training")
    assert "round 2: no client update; the global adapter stays as it was" in logged(caplog)
    assert kept_global(caplog) == [2]
    p = {"Committee": 2 / 7, "Product": 5 / 7}  # |D_i| / |D| over the two replies; tau = 2, 4 steps
    tau_eff = p["Committee"] * 2 + p["Product"] * 4
    move = tau_eff * (p["Committee"] * DELTAS["Committee"] / 2 + p["Product"] * DELTAS["Product"] / 4)
    assert_state(final, {k: v + move for k, v in initial(path).items()}, exact=False)


def test_a_failed_evaluation_is_recorded_and_the_others_count(ws, caplog):
    path = write_plan("loop-evalfail", "fedkd", rounds=1, fraction_train=1.0)
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        _, history, _ = run(path, Script(fail_eval={("Product", 1)}))
    logs(logged(caplog), "round 1", "Product", "RuntimeError", "cannot evaluate")  # the client's line
    rows = rows_of(history, 1)
    assert rows["Product"]["eval_failed"] == 1 and "val_loss" not in rows["Product"]
    assert rows["Product"]["failed"] == 0 and "eval_failed" not in rows["Academic"]
    assert rows["Academic"]["val_loss"] == 1.5


def test_an_evaluation_reply_lost_on_the_way_is_logged_and_recorded_as_a_failed_evaluation(ws, caplog):
    """Its train reply arrived, its evaluation reply did not within the round timeout: as an evaluation that failed
    (eval_failed, a log line naming the round, the client and the wait), not a row that is silent about it."""
    path = write_plan("loop-lost-eval", "fedkd", rounds=1, fraction_train=1.0)
    grid = Grid(path, script := Script(), ["Academic", "Committee", "Product"])
    grid.lost_eval = {("Product", 1)}
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        _, history, _ = run(path, script, grid=grid, timeout=7)
    logs(logged(caplog), "round 1", "Product", "evaluat", "no reply within 7s")
    rows = rows_of(history, 1)
    assert rows["Product"]["failed"] == 0 and "weight" in rows["Product"]  # it trained
    assert rows["Product"]["eval_failed"] == 1 and "val_loss" not in rows["Product"]
    assert "eval_failed" not in rows["Academic"] and rows["Academic"]["val_loss"] == 1.5


def test_privacy_reports_become_the_rows_privacy_fields(ws):
    path = _client_dp(write_plan("loop-privacy", "fedkd", rounds=1, fraction_train=1.0), mode="example")
    _, history, _ = run(path, Script(privacy=True))
    row = rows_of(history, 1)["Academic"]
    assert (row["epsilon"], row["max_grad_norm"], row["dp_steps"], row["clipped_fraction"]) == (3.0, None, 4, 0.25)


def test_a_delta_a_client_cannot_meet_by_its_reported_train_size_is_refused_before_any_round(ws):
    """A deployed server holds no partition: train.py's check of each client's delta against 1 / its training
    examples never ran there, so a site whose own partition holds 5 examples (delta 0.3 >= 1/5) failed each round's
    training (ConfigError, on the client) and, in deployment.serve, the run ended after its last round with every
    round's checkpoint deleted. Now the server checks the train sizes the clients report at admission."""
    from pipeline.common.config import ConfigError

    path = _client_dp(write_plan("loop-delta-sizes", "fedavg", rounds=2, fraction_train=1.0), "example", delta=0.3)
    script = Script(privacy=True, counts={"Academic": {"num-train": 5, "num-valid": 2}})
    with pytest.raises(ConfigError) as err:
        run(path, script)
    names(err.value, "client 'Academic'", "privacy.delta 0.3", "1/5")
    assert not [call for call in script.calls if call[0] == "train"]
    script = Script(privacy=True, counts={"Academic": {"num-train": 50, "num-valid": 2}})
    _, history, _ = run(_client_dp(write_plan("loop-delta-ok", "fedavg", rounds=1), "example", delta=0.01), script)
    assert [r["round"] for r in history] == [1, 1, 1]  # 0.01 < 1/50: the run goes on


@pytest.mark.parametrize("counts, lacks", [({}, "num-train and num-valid"), ({"num-train": 5}, "num-valid")])
def test_a_declared_client_answering_admission_without_its_counts_is_refused_before_any_round(ws, counts, lacks):
    """A declared client whose own site's partition lacks it answers query.identify without num-train / num-valid
    (client_identify); it was admitted, failed every round's training and the run failed only after its last round.
    Admission refuses it, as a client without valid examples, naming the client and the counts it lacks."""
    from pipeline.federation.admission import AdmissionError

    path = write_plan("loop-no-counts", "fedavg", rounds=2, fraction_train=1.0)
    script = Script(counts={"Committee": counts}, fail={("Committee", 1), ("Committee", 2)})  # as its real train
    with pytest.raises(AdmissionError) as err:
        run(path, script)
    names(err.value, "client 'Committee'", lacks, "refused")
    assert not [call for call in script.calls if call[0] == "train"]


# ----------------------------------------------------------------------------------------------- nodes
def test_a_gone_node_is_recorded_absent_and_a_restarted_one_takes_its_clients_place(ws, caplog):
    path = write_plan("loop-nodes", "fedavg", rounds=3, fraction_train=1.0)
    script = Script()
    grid = Grid(path, script, ["Academic", "Committee", "Product"])
    grid.gone = {2: {"Committee"}}
    grid.restart = {3: {"Product"}}
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        final, history, _ = run(path, script, grid=grid)
    logs(logged(caplog), "Product", "1102")
    r2 = rows_of(history, 2)["Committee"]
    assert r2 == {
        "round": 2,
        "client": "Committee",
        "sampled": 0,
        "failed": 0,
        "absent": 1,
        "bytes_down": 0,
        "bytes_up": 0,
    }
    assert trained(script, 2) == ["Academic", "Product"]
    assert trained(script, 3) == ["Academic", "Committee", "Product"]  # Product under its new node id
    assert rows_of(history, 3)["Product"]["failed"] == 0 and "absent" not in rows_of(history, 3)["Committee"]
    all3 = weighted_update(["Academic", "Committee", "Product"], script)
    assert_state(
        final,
        {k: v + 2 * all3 + weighted_update(["Academic", "Product"], script) for k, v in initial(path).items()},
        exact=False,
    )


def test_a_round_in_which_every_node_is_gone_records_them_absent_and_the_next_round_trains(ws, monkeypatch, caplog):
    """Every SuperNode gone in round 2 (absent clients are recorded, not waited for): round 2 aggregates nothing
    and round 3 trains everyone again; Flower's strategies would wait for a node in a view that can never get one."""
    from flwr.serverapp.strategy import strategy_utils

    def no_wait(seconds):
        raise AssertionError("the server waits for a node in a fixed view of none")

    monkeypatch.setattr(strategy_utils, "sleep", no_wait)
    path = write_plan("loop-all-gone", "fedavg", rounds=3, fraction_train=1.0)
    script = Script()
    grid = Grid(path, script, ["Academic", "Committee", "Product"])
    grid.gone = {2: {"Academic", "Committee", "Product"}}
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        final, history, recorder = run(path, script, grid=grid)
    gone = {c: (r["absent"], r["sampled"]) for c, r in rows_of(history, 2).items()}
    assert gone == dict.fromkeys(["Academic", "Committee", "Product"], (1, 0))  # a row each, absent
    assert trained(script, 2) == [] and trained(script, 3) == ["Academic", "Committee", "Product"]
    step = weighted_update(["Academic", "Committee", "Product"], script)  # rounds 1 and 3
    assert_state(final, {k: v + 2 * step for k, v in initial(path).items()}, exact=False)
    assert kept_global(caplog) == [2]


def test_a_node_answering_as_another_client_than_it_was_admitted_as_fails_and_is_asked_its_name_again(ws, caplog):
    """Under --auth a SuperNode restarted with another client-name keeps its node id, so the run's node map still
    holds it as its old client: the node admitted as Academic answers round 2 as 'Committee'. Its train and
    evaluate replies are Academic's failure for the round (naming both names), not aggregated; the node is
    forgotten, so round 3 asks its name again and, Committee's node still answering, leaves it out: Academic is
    absent; restarted as Academic again, round 4 admits it. Before, its update went in as Academic's."""
    path = write_plan("loop-renamed", "fedavg", rounds=4, fraction_train=1.0)
    script = Script()
    grid = Grid(path, script, ["Academic", "Committee", "Product"])
    node = next(n for n in grid.inner.get_node_ids() if grid.name(n) == "Academic")
    grid.rename = {2: {node: "Committee"}, 4: {node: "Academic"}}
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        final, history, _ = run(path, script, grid=grid)
    why = f"node {node} answers as client 'Committee', admitted as 'Academic'"
    a2, a3, a4 = (rows_of(history, rnd)["Academic"] for rnd in (2, 3, 4))
    assert (a2["failed"], a2["error"], a2["eval_failed"]) == (1, why, 1) and "weight_share" not in a2
    assert "val_loss" not in a2 and a3["absent"] == 1 and a3["sampled"] == 0
    assert a4["failed"] == 0 and a4["weight_share"] == pytest.approx(1 / 8) and a4["val_loss"] == 3.0
    logs(logged(caplog), "round 2", "Academic", why)
    logs(logged(caplog), "two nodes claim the same client name 'Committee'", str(node))
    logs(logged(caplog), "client Academic (re)joined as node", str(node))
    assert rows_of(history, 2)["Committee"]["weight_share"] == pytest.approx(2 / 7)
    clients = ["Academic", "Committee", "Product"]
    step = 2 * weighted_update(clients, script) + 2 * weighted_update(clients[1:], script)
    assert_state(final, {k: v + step for k, v in initial(path).items()}, exact=False)


def test_a_node_claiming_a_client_outside_the_plan_is_left_out(ws, caplog):
    from pipeline.federation.admission import connected_nodes

    path = write_plan("loop-stranger", "fedavg", rounds=1, fraction_train=1.0)
    grid = Grid(path, Script(), ["Academic", "Committee", "Product"], extra={5000: "Mallory"})
    node_names = {1000: "Academic", 1001: "Committee", 1002: "Product"}
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        connected = connected_nodes(grid, path, node_names, timeout=5)
    assert len(logged(caplog)) == 1 and logs(logged(caplog), "5000", "'Mallory'")
    assert connected == {1000: "Academic", 1001: "Committee", 1002: "Product"}
    assert node_names == {1000: "Academic", 1001: "Committee", 1002: "Product"}


def test_a_stranger_among_new_nodes_does_not_keep_a_restarted_client_out(ws, caplog):
    """Two new node ids in one round: a stranger (id 500, asked first) and Product's restarted SuperNode (1002,
    Product's old node 9 is gone): the stranger is left out, Product takes its new node."""
    from pipeline.federation.admission import connected_nodes

    path = write_plan("loop-stranger2", "fedavg", rounds=1, fraction_train=1.0)
    grid = Grid(path, Script(), ["Academic", "Committee", "Product"], extra={500: "Mallory"})
    node_names = {1000: "Academic", 1001: "Committee", 9: "Product"}
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        connected = connected_nodes(grid, path, node_names, timeout=5)
    assert (
        len(logged(caplog)) == 2
        and logs(logged(caplog), "500", "'Mallory'")
        and logs(logged(caplog), "Product", "1002")
    )
    assert connected == node_names == {1000: "Academic", 1001: "Committee", 1002: "Product"}


def test_identify_names_every_node_and_rejects_two_claiming_one_client(ws):
    from pipeline.federation.admission import identify_clients

    path = write_plan("loop-identify", "fedavg", rounds=1)
    grid = Grid(path, Script(), ["Academic", "Committee", "Product"])
    assert identify_clients(grid, path, expected=["Academic", "Committee", "Product"], timeout=5) == {
        1000: "Academic",
        1001: "Committee",
        1002: "Product",
    }
    twice = Grid(path, Script(), ["Academic", "Academic"])
    with pytest.raises(RuntimeError, match="two nodes claim the same client name"):
        identify_clients(twice, path, expected=["Academic", "Committee"], timeout=5)


def test_replies_sent_by_the_superlink_for_an_offline_node_are_matched_to_their_message():
    from types import SimpleNamespace

    from flwr.app import Message, RecordDict

    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.protocol import replies_by_node, unanswered

    _set_server_identity(1)
    sent = []
    for node, mid in ((9, "c"), (7, "a"), (8, "b"), (6, "d")):
        m = Message(RecordDict(), dst_node_id=node, message_type="train")
        m.metadata.__dict__["_message_id"] = mid
        sent.append(m)
    by_node = Message(RecordDict(), reply_to=sent[1])
    relayed = Message(RecordDict(), reply_to=sent[2])
    relayed.metadata.__dict__["_src_node_id"] = 1  # the SuperLink's id, not the node's
    grid = SimpleNamespace(send_and_receive=lambda messages, timeout=None: [relayed, by_node])
    replies = replies_by_node(grid, sent, 5)
    assert replies == {8: relayed, 7: by_node}
    assert unanswered(sent, replies) == [9, 6]  # 9 and 6 got no reply, in the order sent


# ----------------------------------------------------------------------------------------------- admission
def _post_addition(name: str, val, max_round: int, rounds: int = 5):
    path = write_plan(
        name,
        "post_addition",
        "extreme/seed0",
        rounds=rounds,
        fraction_train=1.0,
        join={"min_rel_improvement": 0.01, "patience": 1, "max_round": max_round},
    )
    script = Script(val=val)
    _, history, _ = run(path, script, clients=["Academic", "Committee", "Product", "SAMSum"])
    return script, history


def test_the_late_client_hears_nothing_before_it_joins_once_the_others_stop_improving(ws, caplog):
    # the others' mean validation loss: 10, 9 (10 % better), 8.96 (0.4 % better: converged) -> joins in round 4
    losses = {1: 10.0, 2: 9.0, 3: 8.96, 4: 8.9, 5: 8.8}
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        script, history = _post_addition("loop-join", lambda c, r: losses[r], max_round=5)
    logs(logged(caplog), "loop-join", "round 4", "SAMSum")
    late = [(k, r) for k, c, r, _ in script.calls if c == "SAMSum"]
    assert min(r for _, r in late) == 4 and ("train", 4) in late and ("evaluate", 4) in late
    assert min(r["round"] for r in history if r["client"] == "SAMSum") == 4
    assert not any(r.get("absent") for r in history)  # not absent before joining: not admitted yet
    assert rows_of(history, 5)["SAMSum"]["sampled"] == 1


def test_the_late_client_is_recorded_absent_only_once_it_has_joined(ws):
    """Its SuperNode is gone in rounds 1, 2 and 4; it joins at max_round 3: no row at all before joining (not
    admitted, so not missed), a normal one in round 3, an absent one in round 4."""
    path = write_plan(
        "loop-join-gone",
        "post_addition",
        "extreme/seed0",
        rounds=4,
        fraction_train=1.0,
        join={"min_rel_improvement": 0.01, "patience": 1, "max_round": 3},
    )
    script = Script(val=lambda c, r: 10.0 * 0.8**r)  # the others keep improving: it joins at max_round
    clients = ["Academic", "Committee", "Product", "SAMSum"]
    grid = Grid(path, script, clients)
    grid.gone = {1: {"SAMSum"}, 2: {"SAMSum"}, 4: {"SAMSum"}}
    _, history, _ = run(path, script, clients=clients, grid=grid)
    late = {r["round"]: r for r in history if r["client"] == "SAMSum"}
    assert sorted(late) == [3, 4]
    assert late[3]["sampled"] == 1 and "absent" not in late[3]
    assert late[4]["absent"] == 1 and late[4]["sampled"] == 0


def test_the_late_client_joins_at_max_round_while_the_others_still_improve(ws):
    script, history = _post_addition("loop-join-max", lambda c, r: 10.0 * 0.8**r, max_round=3)
    assert min(r["round"] for r in history if r["client"] == "SAMSum") == 3
    assert min(r for k, c, r, _ in script.calls if c == "SAMSum") == 3


def test_a_resumed_run_keeps_the_late_clients_admission(ws, monkeypatch):
    # converged after round 2 (joins in 3), improving again after: only the restored admission lets it train in 4
    losses = {1: 10.0, 2: 10.0, 3: 5.0, 4: 4.0, 5: 3.0}
    path = write_plan(
        "loop-join-resume",
        "post_addition",
        "extreme/seed0",
        rounds=5,
        fraction_train=1.0,
        join={"min_rel_improvement": 0.01, "patience": 1, "max_round": 5},
    )
    with killed_after_checkpoint(monkeypatch, 3):
        run(path, Script(val=lambda c, r: losses[r]), clients=["Academic", "Committee", "Product", "SAMSum"])
    script = Script(val=lambda c, r: losses[r])
    _, history, _ = run(path, script, clients=["Academic", "Committee", "Product", "SAMSum"])
    assert trained(script, 4) == ["Academic", "Committee", "Product", "SAMSum"]
    # killed before it joined (after round 1): the resumed run still keeps it out until round 3
    path = write_plan(
        "loop-join-resume-early",
        "post_addition",
        "extreme/seed0",
        rounds=3,
        fraction_train=1.0,
        join={"min_rel_improvement": 0.01, "patience": 1, "max_round": 3},
    )
    with killed_after_checkpoint(monkeypatch, 1):
        run(path, Script(val=lambda c, r: losses[r]), clients=["Academic", "Committee", "Product", "SAMSum"])
    script = Script(val=lambda c, r: losses[r])
    run(path, script, clients=["Academic", "Committee", "Product", "SAMSum"])
    assert trained(script, 1) == [] and trained(script, 2) == ["Academic", "Committee", "Product"]
    assert trained(script, 3) == ["Academic", "Committee", "Product", "SAMSum"]


def test_a_late_client_outside_the_partition_is_an_error(ws):
    # refused when the plan is made (7a753c6), before a run and its MLflow record start; the server checks it again
    with pytest.raises(ValueError) as err:
        write_plan("loop-late-missing", "post_addition", "domain/seed0", rounds=2)
    assert "train.new_client='SAMSum'; allowed: one of ['Academic', 'Committee', 'Product']" in str(err.value)


def test_a_serverless_method_has_no_server_loop(ws):
    path = write_plan("loop-single", "single", rounds=1)
    with pytest.raises(ValueError, match="method 'single' is not federated"):
        run(path, Script())


# ----------------------------------------------------------------------------------------------- the join rule
def _history(means: list[float], spread: float = 0.5) -> list[dict]:
    """Two existing clients whose mean validation loss in round r is means[r - 1]."""
    return [
        {"round": r, "client": c, "val_loss": m + d}
        for r, m in enumerate(means, start=1)
        for c, d in (("A", -spread), ("B", spread))
    ]


losses = st.lists(st.floats(0.5, 20.0), min_size=0, max_size=6)


@settings(max_examples=60, deadline=None)
@given(
    means=losses,
    patience=st.integers(1, 3),
    threshold=st.floats(0.0, 0.5),
    max_round=st.integers(2, 8),
    noise=st.lists(st.floats(0.0, 50.0), min_size=0, max_size=4),
)
def test_join_reads_only_the_other_clients_earlier_rounds(means, patience, threshold, max_round, noise):
    """The decision for round r is a function of the existing clients' rows of rounds < r: rows of the late
    client, of round r and later, and evaluation rows without a validation loss change nothing; from max_round on
    the answer is yes."""
    from pipeline.experiments.train_config import JoinConfig
    from pipeline.federation.server_app import new_client_joins

    join = JoinConfig(min_rel_improvement=threshold, patience=patience, max_round=max_round)
    rnd = len(means) + 1
    history = _history(means)
    decided = new_client_joins(rnd, history, "New", join)
    extra = (
        [{"round": r, "client": "New", "val_loss": v} for r, v in enumerate(noise, start=1)]
        + [{"round": rnd + i, "client": c, "val_loss": v} for i, v in enumerate(noise) for c in "AB"]
        + [{"round": 1, "client": "A", "eval_failed": 1}]
    )
    assert new_client_joins(rnd, history + extra, "New", join) is decided
    if rnd >= max_round:
        assert decided
    elif len(means) < patience + 1:
        assert not decided  # not enough rounds to see `patience` improvements


@settings(max_examples=60, deadline=None)
@given(
    start=st.floats(1.0, 20.0),
    n=st.integers(2, 6),
    patience=st.integers(1, 3),
    threshold=st.floats(0.005, 0.3),
    margin=st.floats(1.05, 3.0),
)
def test_join_waits_while_the_others_improve_and_admits_once_they_stall(start, n, patience, threshold, margin):
    """Means that drop by more than the threshold every round (relative to the best so far) keep the late client
    out until max_round; flat means admit it as soon as `patience` flat rounds follow a first one."""
    from pipeline.experiments.train_config import JoinConfig
    from pipeline.federation.server_app import new_client_joins

    join = JoinConfig(min_rel_improvement=threshold, patience=patience, max_round=99)
    factor = 1.0 - min(threshold * margin, 0.9)
    improving = [start * factor**i for i in range(n)]
    assert not new_client_joins(n + 1, _history(improving, spread=0.0), "New", join)
    flat = [start] * n
    assert new_client_joins(n + 1, _history(flat, spread=0.0), "New", join) is (n >= patience + 1)
    # a late stall counts only when the last `patience` rounds all stall
    stalled = improving + [improving[-1]] * patience
    assert new_client_joins(len(stalled) + 1, _history(stalled, spread=0.0), "New", join)
    if patience > 1:
        almost = improving + [improving[-1]] * (patience - 1)
        assert not new_client_joins(len(almost) + 1, _history(almost, spread=0.0), "New", join)


def test_improvement_is_measured_against_the_best_earlier_round_not_the_last():
    from pipeline.experiments.train_config import JoinConfig
    from pipeline.federation.server_app import new_client_joins

    join = JoinConfig(min_rel_improvement=0.01, patience=1, max_round=9)
    # 10 -> 12 (worse) -> 9.95: 17 % better than round 2 but only 0.5 % better than the best (10): converged
    assert new_client_joins(4, _history([10.0, 12.0, 9.95]), "New", join)
    # 10 -> 12 -> 9.0: 10 % better than the best: still learning
    assert not new_client_joins(4, _history([10.0, 12.0, 9.0]), "New", join)
    # the mean over the clients, not one client: A improves 50 %, B worsens, the mean is flat
    history = [
        {"round": 1, "client": "A", "val_loss": 4.0},
        {"round": 1, "client": "B", "val_loss": 6.0},
        {"round": 2, "client": "A", "val_loss": 2.0},
        {"round": 2, "client": "B", "val_loss": 8.0},
    ]
    assert new_client_joins(3, history, "New", join)
    # a best of exactly 0 gives no relative improvement (converged), not a division by zero
    assert new_client_joins(3, _history([0.0, 0.0], spread=0.0), "New", join)


def test_an_improvement_of_exactly_the_threshold_is_still_learning():
    """'Improved by less than min_rel_improvement' is strict: 1.0 -> 0.5 is exactly 50 %, so with a 50 % threshold
    the others are still learning; 1.0 -> 0.75 (25 %) is below it: the late client joins."""
    from pipeline.experiments.train_config import JoinConfig
    from pipeline.federation.server_app import new_client_joins

    join = JoinConfig(min_rel_improvement=0.5, patience=1, max_round=9)
    assert not new_client_joins(3, _history([1.0, 0.5], spread=0.0), "New", join)
    assert new_client_joins(3, _history([1.0, 0.75], spread=0.0), "New", join)


def test_the_strategy_sees_the_grid_restricted_to_the_admitted_nodes(ws):
    """GridView with node ids: the node list is the admitted subset (a copy)."""
    from pipeline.federation.protocol import GridView

    class Recording:
        def get_node_ids(self):
            return [1, 2, 3]

    inner = Recording()
    nodes = [3, 1]
    view = GridView(inner, nodes)
    nodes.append(2)  # the view keeps its own list
    assert list(view.get_node_ids()) == [3, 1] and view.get_node_ids() is not view.get_node_ids()
    assert list(GridView(inner).get_node_ids()) == [1, 2, 3]


def test_a_node_failing_to_identify_is_left_out_until_it_answers(ws, caplog):
    from pipeline.federation.admission import connected_nodes, identify_clients

    path = write_plan("loop-badnode", "fedavg", rounds=1)
    script = Script()
    grid = Grid(path, script, ["Academic", "Committee", "Product"])
    grid.inner.contexts[1001].node_config["client-name"] = None  # cannot say who it is
    with pytest.raises(RuntimeError, match="node 1001 failed to identify: RuntimeError in client node 1001's"):
        identify_clients(grid, path, expected=["Academic", "Committee", "Product"], timeout=5)
    grid.inner.contexts[1001].node_config["client-name"] = "Committee"
    node_names = {1000: "Academic", 1001: "Committee", 1002: "Product"}
    grid.inner.contexts[1099] = grid.inner.contexts.pop(1001)  # Committee's node restarts as a new node
    grid.inner.contexts[1099].node_config["client-name"] = None
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        assert connected_nodes(grid, path, node_names, timeout=5) == {1000: "Academic", 1002: "Product"}
    logs(logged(caplog), "node 1099", "left out", "RuntimeError")  # the server's line; the text: the client's line
    logs(logged(caplog), "node 1099", "RuntimeError", "no client name configured")
    assert node_names == {1000: "Academic", 1001: "Committee", 1002: "Product"}
    grid.inner.contexts[1099].node_config["client-name"] = "Committee"  # asked again, it answers
    assert connected_nodes(grid, path, node_names, timeout=5) == {1000: "Academic", 1002: "Product", 1099: "Committee"}
    assert node_names == {1000: "Academic", 1002: "Product", 1099: "Committee"}  # the old node is forgotten


def _metric_record():
    from flwr.app import MetricRecord

    return MetricRecord({"client-name": 1})


@pytest.mark.parametrize(
    "corrupt, problem",
    [
        (lambda c: c.pop("identity"), "identity"),
        (lambda c: c["identity"].pop("client-name"), "client-name"),
        (lambda c: (c.pop("identity"), c.__setitem__("identity", _metric_record())), "identity"),
        (lambda c: c["identity"].__setitem__("num-train", "many"), "num-train"),
        (lambda c: c["identity"].__setitem__("num-train", 2.7), "num-train"),  # int() read it as 2
        (lambda c: c["identity"].__setitem__("num-valid", 0.5), "num-valid"),  # and this as 0
        (lambda c: c["identity"].__setitem__("num-valid", -1), "num-valid"),  # admission refused only 0
    ],
)
def test_a_malformed_identify_reply_leaves_its_node_out_not_the_servers_run(ws, caplog, corrupt, problem):
    """A deployed node answering query.identify without a readable identity (no identity ConfigRecord, no client-name,
    a num-train that is no whole number) is a node that failed to identify: at admission the run names it, mid-run it
    is left out with one line naming the node and the problem, and asked again next time (before: KeyError,
    TypeError, ValueError ended the run)."""
    from pipeline.federation.admission import connected_nodes, identify_clients

    path = write_plan("loop-badidentity", "fedavg", rounds=1)
    grid = Grid(path, Script(), ["Academic", "Committee", "Product"])
    send, bad = grid.send_and_receive, [1002]

    def send_and_receive(messages, *, timeout=None):
        replies = list(send(messages, timeout=timeout))
        for r in replies:
            if r.metadata.src_node_id in bad:
                r.content["identity"]["num-train"] = 5  # the reply under start_over, with its sizes
                corrupt(r.content)
        return replies

    grid.send_and_receive = send_and_receive
    with pytest.raises(RuntimeError, match=f"node 1002 failed to identify: .*{problem}") as err:
        identify_clients(grid, path, expected=["Academic", "Committee", "Product"], timeout=5, sizes={})
    assert "metrics" not in str(err.value)  # an identity record (it read "its metrics lack ... {'num-train': 2.7}")
    node_names = {1000: "Academic", 1001: "Committee", 9: "Product"}  # Product's SuperNode restarts as node 1002
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        assert connected_nodes(grid, path, node_names, timeout=5) == {1000: "Academic", 1001: "Committee"}
    assert len(logged(caplog)) == 1 and logs(logged(caplog), "node 1002", "left out", problem)
    assert node_names == {1000: "Academic", 1001: "Committee", 9: "Product"}
    bad.clear()  # asked again, it answers
    assert connected_nodes(grid, path, node_names, timeout=5) == {1000: "Academic", 1001: "Committee", 1002: "Product"}


def test_the_server_waits_for_every_planned_client_to_connect(ws, caplog):
    from pipeline.federation.admission import identify_clients

    path = write_plan("loop-wait", "fedavg", rounds=1)
    grid = Grid(path, Script(), ["Academic", "Committee", "Product"])
    polls = []

    def late_node():  # the third node registers after the server's first look
        polls.append(1)
        return [1000, 1001] if len(polls) == 1 else [1000, 1001, 1002]

    grid.get_node_ids = late_node
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        names = identify_clients(grid, path, expected=["Academic", "Committee", "Product"], timeout=30)
    assert names == {1000: "Academic", 1001: "Committee", 1002: "Product"}
    assert len(logged(caplog)) == 1 and logs(logged(caplog), "2 of 3") and len(polls) == 2


def _superlink_answers_for(grid: Grid, client: str, restarted_as: int | None) -> None:
    """During admission ``client``'s SuperNode goes offline before it identifies: the SuperLink answers the server's
    query.identify itself (flwr's NODE_UNAVAILABLE reply, from its own id); it comes back as ``restarted_as``."""
    from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

    send, down = grid.send_and_receive, []

    def send_and_receive(messages, *, timeout=None):
        messages = list(messages)
        gone = [m for m in messages if not down and grid.name(m.metadata.dst_node_id) == client]
        down.extend(m.metadata.dst_node_id for m in gone)
        replies = [r for r in send(messages, timeout=timeout) if r.metadata.src_node_id not in down]
        for m in gone:
            replies.append(create_message_error_unavailable_res_message(m.metadata, "node_unavail"))
            ctx = grid.inner.contexts.pop(m.metadata.dst_node_id)
            if restarted_as is not None:
                grid.inner.contexts[restarted_as] = ctx
        return replies

    grid.send_and_receive = send_and_receive


@pytest.mark.parametrize("restarted_as", [1101, None])
def test_a_node_going_offline_before_it_identifies_is_left_out_and_its_client_awaited(ws, caplog, restarted_as):
    """docs/federation.md: a declared client whose SuperNode has not joined within the admission timeout fails the run.
    Committee's SuperNode drops before it answers query.identify: one line names its node, and the server waits for
    Committee (it restarts as node 1101 and is admitted; or never comes back: the admission timeout names it)."""
    from pipeline.federation.admission import AdmissionError, identify_clients

    path = write_plan("loop-offline-admission", "fedavg", rounds=1)
    grid = Grid(path, Script(), ["Academic", "Committee", "Product"])
    _superlink_answers_for(grid, "Committee", restarted_as)
    expected = ["Academic", "Committee", "Product"]
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        if restarted_as is None:
            with pytest.raises(AdmissionError) as err:
                identify_clients(grid, path, expected=expected, timeout=1)
            names(err.value, "['Committee']", "never joined")
        else:
            names_ = identify_clients(grid, path, expected=expected, timeout=30)
            assert names_ == {1000: "Academic", 1002: "Product", 1101: "Committee"}
    logs(logged(caplog), "node 1001", "left out")


def _crashed_but_listed(grid: Grid, node: int, restarted_as: int) -> list[int]:
    """``node``'s SuperNode crashed and came back without --auth as ``restarted_as``, while the SuperLink still lists
    the old id (until two missed heartbeats mark it offline): a message to it is answered by the SuperLink with
    NODE_UNAVAILABLE once it does. Returns the node ids the SuperLink lists."""
    from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

    grid.inner.contexts[restarted_as] = grid.inner.contexts.pop(node)
    send = grid.send_and_receive

    def send_and_receive(messages, *, timeout=None):
        messages = list(messages)
        dead = [m for m in messages if m.metadata.dst_node_id == node]
        live = [m for m in messages if m.metadata.dst_node_id != node]
        replies = list(send(live, timeout=timeout)) if live else []
        return replies + [create_message_error_unavailable_res_message(m.metadata, "node_unavail") for m in dead]

    grid.send_and_receive = send_and_receive
    return sorted([*grid.inner.contexts, node])


def test_mid_run_a_second_node_claiming_a_held_client_is_refused_while_the_holder_answers(ws, caplog):
    """A SuperNode of another experiment (node 5000) names Product, whose node 1002 is connected and answers: it
    is refused with one line naming both nodes, round after round, and 1002 keeps Product (it took Product's slot,
    and the slot went back and forth, each round). A holder that no longer answers (crashed, still listed) is
    Product's SuperNode restarted: the new node takes its place."""
    from pipeline.federation.admission import connected_nodes

    path = write_plan("loop-usurper", "fedavg", rounds=1, fraction_train=1.0)
    grid = Grid(path, Script(), ["Academic", "Committee", "Product"], extra={5000: "Product"})
    node_names = {1000: "Academic", 1001: "Committee", 1002: "Product"}
    for _ in range(2):  # two rounds
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
            connected = connected_nodes(grid, path, node_names, timeout=5)
        assert connected == node_names == {1000: "Academic", 1001: "Committee", 1002: "Product"}
        assert len(logged(caplog)) == 1 and logs(logged(caplog), "5000", "1002", "'Product'")
    del grid.inner.contexts[5000]
    listed = _crashed_but_listed(grid, 1002, restarted_as=1102)
    grid.get_node_ids = lambda: listed
    assert connected_nodes(grid, path, node_names, timeout=5) == {1000: "Academic", 1001: "Committee", 1102: "Product"}
    assert node_names == {1000: "Academic", 1001: "Committee", 1102: "Product"}


def _of_another_plan(grid: Grid, node: int, name: str) -> None:
    """Node ``node``: a SuperNode of another experiment (its node config names its own plan) naming ``name``."""
    from flwr.app import Context, RecordDict

    other = write_plan(f"{name.lower()}-elsewhere", "fedavg", rounds=2)
    config = {"client-name": name, "plan": other}
    grid.inner.contexts[node] = Context(run_id=1, node_id=node, node_config=config, state=RecordDict(), run_config={})


def test_mid_run_a_node_of_another_plan_does_not_take_the_slot_of_an_absent_client(ws, caplog):
    """docs/federation.md: the server admits the clients of its plan. Product's SuperNode (1002) is gone when a
    SuperNode of another experiment naming Product (5000, its own plan) connects: it is left out with one line
    saying it serves another plan, Product stays absent, and Product's SuperNode restarted (1102) takes its place
    (before, 5000 took Product's slot, got this run's messages, and 1102 was refused: 'the holder answers')."""
    from pipeline.federation.admission import connected_nodes

    path = write_plan("loop-foreign", "fedavg", rounds=1, fraction_train=1.0)
    grid = Grid(path, Script(), ["Academic", "Committee", "Product"])
    product = grid.inner.contexts.pop(1002)
    _of_another_plan(grid, 5000, "Product")
    node_names = {1000: "Academic", 1001: "Committee", 1002: "Product"}
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        assert connected_nodes(grid, path, node_names, timeout=5) == {1000: "Academic", 1001: "Committee"}
    assert len(logged(caplog)) == 1 and logs(logged(caplog), "node 5000", "'Product'", "another plan", path)
    product.node_id = 1102
    grid.inner.contexts[1102] = product
    assert connected_nodes(grid, path, node_names, timeout=5) == {1000: "Academic", 1001: "Committee", 1102: "Product"}


def test_at_admission_a_node_of_another_plan_naming_a_declared_client_is_refused(ws, caplog):
    """A SuperNode of another experiment naming Product (5000, its own plan) connects before Product's (1002, a poll
    later): it is refused with one line saying it serves another plan, and Product's node is admitted (before, 5000
    took Product and the run failed when 1002 came: 'two nodes claim the same client name')."""
    from pipeline.federation.admission import identify_clients

    path = write_plan("adm-foreign", "fedavg", rounds=1)
    grid = Grid(path, Script(), ["Academic", "Committee", "Product"])
    _of_another_plan(grid, 5000, "Product")
    polls, every = [], grid.get_node_ids

    def product_late():
        polls.append(1)
        return [n for n in every() if len(polls) > 1 or n != 1002]

    grid.get_node_ids = product_late
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        names_ = identify_clients(grid, path, expected=["Academic", "Committee", "Product"], timeout=10)
    assert names_ == {1000: "Academic", 1001: "Committee", 1002: "Product"}
    refusals = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(refusals) == 1 and logs(refusals, "node 5000", "'Product'", "another plan")


def test_a_supernode_restarted_during_admission_while_its_old_id_is_listed_is_admitted(ws, caplog):
    """Committee identifies as node 1001, crashes and comes back (no --auth) as node 1101 while the SuperLink still
    lists 1001 and Product has not joined yet: Committee is admitted as 1101 (its old node no longer answers), not
    refused as 'two nodes claim the same client name'."""
    from pipeline.federation.admission import identify_clients

    path = write_plan("adm-restart-listed", "fedavg", rounds=1)
    grid = Grid(path, Script(), ["Academic", "Committee", "Product"])
    polls = []

    def nodes():
        polls.append(1)
        if len(polls) == 1:
            return [1000, 1001]
        if len(polls) == 2:  # Committee's SuperNode crashed after it identified and restarted as 1101
            grid.listed = _crashed_but_listed(grid, 1001, restarted_as=1101)
        return grid.listed

    grid.get_node_ids = nodes
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        assert identify_clients(grid, path, expected=["Academic", "Committee", "Product"], timeout=30) == {
            1000: "Academic",
            1101: "Committee",
            1002: "Product",
        }


def test_a_refused_node_is_asked_again_at_admission_and_each_refusal_is_logged_once(ws, caplog):
    """With --auth a SuperNode keeps its node id across restarts: Product's node 1002 is refused for a misspelt
    name ("Prodcut"), its operator fixes the name and restarts it within the admission timeout: asked again, it is
    admitted. A stranger connected the whole time is refused with one line, not one a poll."""
    from pipeline.federation.admission import identify_clients

    path = write_plan("adm-typo-fixed", "fedavg", rounds=1)
    grid = Grid(path, Script(), ["Academic", "Committee", "Prodcut"], extra={5000: "Mallory"})
    polls = []
    every = grid.get_node_ids

    def nodes():
        polls.append(1)
        if len(polls) == 3:  # the same node id, its client name fixed
            grid.inner.contexts[1002].node_config["client-name"] = "Product"
        return every()

    grid.get_node_ids = nodes
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        names_ = identify_clients(grid, path, expected=["Academic", "Committee", "Product"], timeout=10)
    assert names_ == {1000: "Academic", 1001: "Committee", 1002: "Product"}
    refusals = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(refusals) == 2 and logs(refusals, "1002", "'Prodcut'") and logs(refusals, "5000", "'Mallory'")


# ----------------------------------------------------------------------------------------------- SecAgg+ bookkeeping
# The train step of a SecAgg+ round (_train_secure) on a scripted SecureAggregator: the protocol itself is tested end
# to end in tests/test_secure_aggregation.py; here, what the server records from its outcome for every client.
def _secure_metrics(weight: int, clipped: int = 0) -> dict:
    return {
        N: weight,
        "num-trained": weight,
        "num-steps": 2 * weight,
        "num-tokens": 10 * weight,
        "train-loss": 0.5 * weight,
        "ce": 0.25 * weight,
        "kd": 0.125,
        "kd-fraction": 0.5,
        "proximal": 0.0,
        "secagg-clipped": clipped,
    }


class _ScriptedSecure:
    def __init__(self, result):
        self.result, self.calls = result, []

    def train_round(self, grid, messages, rnd):
        self.calls.append((grid, len(messages), rnd))
        return self.result


def _secure_rows(names):
    return {n: {"round": 3, "client": n, "sampled": 1, "failed": 0, "bytes_down": 0, "bytes_up": 0} for n in names}


CLIENT_DP = {"mode": "client", "noise_multiplier": 0.0, "clipping_norm": 1.0, "clipping_side": "client"}


def _secagg_plan(**privacy):
    """What _train_secure reads of a plan, its privacy group: SecAgg+ with ``privacy``."""
    from types import SimpleNamespace

    from pipeline.common.config import from_dict
    from pipeline.experiments.privacy import PrivacyConfig

    return SimpleNamespace(privacy=from_dict(PrivacyConfig, {"secure_aggregation": True, **privacy}, "privacy"))


def test_a_secure_round_records_each_clients_bytes_and_metrics_and_returns_the_unmasked_mean(caplog):
    from pipeline.federation.server_app import _Round, _train_secure
    from pipeline.privacy.secure_aggregation import NodeOutcome, SecureRound

    names = {11: "Academic", 12: "Committee", 13: "Product"}
    mean = object()
    result = SecureRound(
        arrays=mean,
        threshold=2,
        num_shares=3,
        in_sum={11, 12, 13},
        nodes={
            11: NodeOutcome(metrics=_secure_metrics(1), bytes_down=100, bytes_up=40),
            12: NodeOutcome(metrics=_secure_metrics(2), bytes_down=101, bytes_up=41),
            13: NodeOutcome(
                metrics=_secure_metrics(5), failed_stage="unmask", error="no answer", bytes_down=102, bytes_up=42
            ),
        },
    )
    secure, rows = _ScriptedSecure(result), _secure_rows(names.values())
    grid = object()
    exchange = _Round(grid, None, 3, rows, names, 5.0)
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        assert _train_secure(secure, exchange, ["m"] * 3, _secagg_plan()) is mean
    assert secure.calls == [(grid, 3, 3)]
    for node, name in names.items():
        w = {11: 1, 12: 2, 13: 5}[node]
        assert rows[name]["bytes_down"] == 100 + node - 11 and rows[name]["bytes_up"] == 40 + node - 11
        assert rows[name]["failed"] == 0 and "error" not in rows[name]
        assert (rows[name]["weight"], rows[name]["n_steps"], rows[name]["n_tokens"]) == (w, 2 * w, 10 * w)
        assert rows[name]["train_loss"] == 0.5 * w and rows[name]["secagg_clipped"] == 0
    # the client lost at unmask is in the sum (the others' shares unmasked it): recorded, not failed
    assert rows["Product"]["secagg_error"] == "SecAgg+ unmask: no answer"
    assert "secagg_error" not in rows["Academic"] and exchange.clipped == {}
    assert logged(caplog) == []  # every sampled client is in the sum: nothing to report


def test_a_client_outside_the_secure_sum_is_failed_with_its_stage_and_the_sum_of_the_others_is_logged(caplog):
    from pipeline.federation.server_app import _Round, _train_secure
    from pipeline.privacy.secure_aggregation import NodeOutcome, SecureRound

    names = {11: "Academic", 12: "Committee", 13: "Product"}
    mean = object()
    result = SecureRound(
        arrays=mean,
        threshold=2,
        num_shares=3,
        in_sum={11, 13},
        nodes={
            11: NodeOutcome(metrics=_secure_metrics(1)),
            13: NodeOutcome(metrics=_secure_metrics(5)),
            12: NodeOutcome(failed_stage="share_keys", error="timeout", bytes_down=7),
        },
    )
    rows = _secure_rows(names.values())
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        exchange = _Round(None, None, 4, rows, names, 5.0)
        assert _train_secure(_ScriptedSecure(result), exchange, ["m"] * 3, _secagg_plan()) is mean
    assert rows["Committee"]["failed"] == 1 and rows["Committee"]["error"] == "SecAgg+ share_keys: timeout"
    assert rows["Committee"]["bytes_down"] == 7 and "weight" not in rows["Committee"]
    assert rows["Academic"]["failed"] == 0 and rows["Product"]["failed"] == 0
    assert len(logged(caplog)) == 2 and logs(logged(caplog), "round 4", "Committee", "share_keys")
    logs(logged(caplog), "round 4", "2 of 3")


def test_a_halted_secure_round_fails_every_client_and_aggregates_nothing(caplog):
    from pipeline.federation.server_app import _Round, _train_secure
    from pipeline.privacy.secure_aggregation import NodeOutcome, SecureRound

    names = {11: "Academic", 12: "Committee"}
    result = SecureRound(
        arrays=None,
        threshold=2,
        num_shares=2,
        in_sum=set(),
        halted="too few shares",
        clipped_count=1,
        nodes={11: NodeOutcome(metrics=_secure_metrics(1)), 12: NodeOutcome(failed_stage="setup", error="gone")},
    )
    rows = _secure_rows(names.values())
    exchange = _Round(None, None, 2, rows, names, 5.0)
    assert _train_secure(_ScriptedSecure(result), exchange, ["m"] * 2, _secagg_plan()) is None
    assert rows["Academic"]["failed"] == 1 and rows["Academic"]["error"] == "too few shares"
    assert rows["Committee"]["failed"] == 1 and rows["Committee"]["error"] == "SecAgg+ setup: gone"
    assert exchange.clipped == {}


@pytest.mark.parametrize("clipped", [[1, 2], -1])
def test_a_summed_client_whose_metrics_cannot_be_decoded_fails_the_secure_round_as_a_halted_one(caplog, clipped):
    """Committee's masked vector is in the sum, its metrics hold a list for secagg-clipped (int() raised TypeError
    and ended the run) or a negative count (taken before): the sum cannot be taken apart, so the round is not
    released, as when the protocol halts: every sampled client failed, saying why, the global stays (None); under
    client-level DP the wrapper releases W and its noise (nobody in the sum: arrays None, 0 clipped of 0)."""
    from pipeline.federation.server_app import _Round, _train_secure
    from pipeline.privacy.secure_aggregation import NodeOutcome, SecureRound

    class Wrapper:
        calls: list = []

        def release_secure_mean(self, rnd, arrays, clipped_count, summed):
            self.calls.append((rnd, arrays, clipped_count, summed))
            return "W and noise"

    names = {11: "Academic", 12: "Committee", 13: "Product"}
    for strategy, returned in ((None, None), (Wrapper(), "W and noise")):
        nodes = {
            11: NodeOutcome(metrics=_secure_metrics(1)),
            12: NodeOutcome(metrics=_secure_metrics(2) | {"secagg-clipped": clipped}),
            13: NodeOutcome(failed_stage="share_keys", error="timeout"),
        }
        result = SecureRound(arrays=object(), threshold=2, num_shares=3, in_sum={11, 12}, clipped_count=0, nodes=nodes)
        rows = _secure_rows(names.values())
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
            assert _train_secure(
                _ScriptedSecure(result),
                _Round(None, strategy, 3, rows, names, 5.0, strategy),
                ["m"] * 3,
                _secagg_plan(),
            ) == (returned)
        assert all(rows[c]["failed"] == 1 for c in rows) and rows["Product"]["error"] == "SecAgg+ share_keys: timeout"
        assert "secagg-clipped" in rows["Committee"]["error"] and "['Committee']" in rows["Academic"]["error"]
        assert len(logged(caplog)) == 3 and logs(logged(caplog), "round 3", "Committee", "secagg-clipped")
    assert Wrapper.calls == [(3, None, 0, 0)]


DP_REPORT = {"dp-epsilon": 2.0, "dp-delta": 1e-5, "dp-noise-multiplier": 1.0, "dp-max-grad-norm": 1.0}
DP_REPORT |= {"dp-sample-rate": 0.5, "dp-steps": 4, "dp-examples": 8, "dp-clipped": 2}


@pytest.mark.parametrize("corrupt, problem", [(None, None), ("no report", "dp-epsilon"), ("extra", "['extra']")])
def test_a_secure_reply_without_the_plans_keys_or_with_others_is_refused_as_in_the_clear(caplog, corrupt, problem):
    """Example-level DP under SecAgg+: a reply holds the DP-SGD report and no key the plan's replies lack, as in the
    clear (test_a_reply_with_other_metric_keys_or_records_than_the_plans_is_that_clients_failure). Committee's masked
    vector is in the sum, its metrics without the report or with a key 'extra': before, its row was recorded without
    a report (the DP keys were taken only when a reply held dp-epsilon) or the key was ignored, and the sum released;
    now its metrics cannot be decoded and the sum is not released (None), every client failed, Committee's row and
    log line naming the key. Well-formed: the sum released, each row its report (clipped fraction 2 / 8 by hand)."""
    from pipeline.federation.server_app import _Round, _train_secure
    from pipeline.privacy.secure_aggregation import NodeOutcome, SecureRound

    names = {11: "Academic", 12: "Committee", 13: "Product"}
    committee = _secure_metrics(2) | DP_REPORT
    committee = {"no report": _secure_metrics(2), "extra": committee | {"extra": 1.0}}.get(corrupt, committee)
    nodes = {11: _secure_metrics(1) | DP_REPORT, 12: committee, 13: _secure_metrics(5) | DP_REPORT}
    mean = object()
    result = SecureRound(mean, {n: NodeOutcome(metrics=m) for n, m in nodes.items()}, {11, 12, 13}, 2, 3)
    rows = _secure_rows(names.values())
    plan = _secagg_plan(mode="example", noise_multiplier=1.0)
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        released = _train_secure(_ScriptedSecure(result), _Round(None, None, 3, rows, names, 5.0), ["m"] * 3, plan)
    if corrupt is None:
        assert released is mean and logged(caplog) == []
        assert all(
            (r["failed"], r["epsilon"], r["dp_steps"], r["clipped_fraction"]) == (0, 2.0, 4, 0.25)
            for r in rows.values()
        )
        return
    assert released is None and all(rows[c]["failed"] == 1 for c in rows)
    assert problem in rows["Committee"]["error"] and "['Committee']" in rows["Academic"]["error"]
    logs(logged(caplog), "round 3", "Committee", problem)


@pytest.mark.parametrize("corrupt, problem", [("no metrics", "num-examples"), ("a list", "secagg-clipped")])
def test_a_masked_vector_reply_whose_metrics_flower_cannot_read_halts_the_round_not_the_run(caplog, corrupt, problem):
    """The real SecAgg+ workflow over the in-process grid: Committee's masked-vector reply comes without its
    fitres.metrics record, or with secagg-clipped a list (a non-genuine client: Flower's mod converts a genuine one
    through FitRes). Before, the observer's read (KeyError) or Flower's FitRes conversion (TypeError) raised inside the
    workflow and ended the run; now Committee's vector is in the sum, its metrics cannot be decoded, and the round is
    not released as in 34351e7: None returned, every sampled client failed."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from pipeline.experiments.privacy import SecAggConfig
    from pipeline.federation.engines import InProcessGrid, _set_server_identity
    from pipeline.federation.protocol import ARRAYS_KEY, CONFIG_KEY, METRICS_KEY
    from pipeline.federation.server_app import _Round, _train_secure
    from pipeline.privacy.secure_aggregation import SecureAggregator, legacy_fit, secure_aggregation_mod

    def local(msg, context):  # each client's update: 0.5 x its index, 2 examples
        arrays = ArrayRecord({"w": Array(np.full(3, 0.5 * (context.node_id - 999), dtype=np.float32))})
        metrics = {k: v for k, v in _secure_metrics(2).items() if k != "secagg-clipped"}
        return Message(RecordDict({ARRAYS_KEY: arrays, METRICS_KEY: MetricRecord(metrics)}), reply_to=msg)

    app = ClientApp(mods=[secure_aggregation_mod])
    app.train()(lambda msg, context: legacy_fit(msg, context, local))
    names = {1000: "Academic", 1001: "Committee", 1002: "Product"}
    grid = InProcessGrid(app, [{"client-name": c} for c in names.values()])
    _set_server_identity(grid.run.run_id)
    send = grid.send_and_receive

    def send_and_receive(messages, *, timeout=None):
        replies = list(send(messages, timeout=timeout))
        for r in (r for r in replies if r.metadata.src_node_id == 1001):
            if (metrics := r.content.config_records.get("fitres.metrics")) is not None and corrupt == "no metrics":
                r.content.config_records.pop("fitres.metrics")
            elif metrics is not None:
                metrics["secagg-clipped"] = [1, 2]
        return replies

    grid.send_and_receive = send_and_receive
    global_ = ArrayRecord({"w": Array(np.zeros(3, dtype=np.float32))})
    msgs = [
        Message(RecordDict({ARRAYS_KEY: global_, CONFIG_KEY: ConfigRecord({})}), dst_node_id=n, message_type="train")
        for n in names
    ]
    rows = _secure_rows(names.values())
    secure = SecureAggregator(SecAggConfig(), max_weight=2, timeout=5.0)
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        assert _train_secure(secure, _Round(grid, None, 3, rows, names, 5.0), msgs, _secagg_plan()) is None
    assert all(rows[c]["failed"] == 1 for c in rows) and "['Committee']" in rows["Academic"]["error"]
    assert rows["Committee"]["error"].startswith("it cannot be decoded") and problem in rows["Committee"]["error"]
    assert len(logged(caplog)) == 3 and logs(logged(caplog), "round 3", "Committee", problem)


def test_under_client_dp_the_secure_mean_gets_the_wrappers_noise_and_each_summed_client_the_clipped_share():
    from pipeline.federation.server_app import _Round, _train_secure
    from pipeline.privacy.secure_aggregation import NodeOutcome, SecureRound

    class Wrapper:
        def __init__(self):
            self.calls = []

        def release_secure_mean(self, rnd, arrays, clipped_count, summed):
            self.calls.append((rnd, arrays, clipped_count, summed))
            return "noised"

    names = {11: "Academic", 12: "Committee", 13: "Product", 14: "SAMSum"}
    mean = object()
    result = SecureRound(
        arrays=mean,
        threshold=3,
        num_shares=4,
        in_sum={11, 12, 14},
        clipped_count=1,
        nodes={
            11: NodeOutcome(metrics=_secure_metrics(1, clipped=1)),
            12: NodeOutcome(metrics=_secure_metrics(1)),
            13: NodeOutcome(failed_stage="training", error="crashed"),
            14: NodeOutcome(metrics=_secure_metrics(1)),
        },
    )
    wrapper = Wrapper()
    rows = _secure_rows(names.values())
    exchange = _Round(None, wrapper, 6, rows, names, 5.0)
    assert _train_secure(_ScriptedSecure(result), exchange, ["m"] * 4, _secagg_plan(**CLIENT_DP)) == "noised"
    assert wrapper.calls == [(6, mean, 1, 3)]
    assert exchange.clipped == {"Academic": (1 / 3, None), "Committee": (1 / 3, None), "SAMSum": (1 / 3, None)}
    assert rows["Academic"]["secagg_clipped"] == 1 and rows["Committee"]["secagg_clipped"] == 0


class _InTheClearSecure:
    """Stands in for SecureAggregator in run_server: the same sampled train messages, the replies' weighted mean
    computed in the clear (what SecAgg+ unmasks); ``lost_at_unmask`` answered with its metrics but is not in the
    sum."""

    made: list = []
    lost_at_unmask = "Product"

    def __init__(self, cfg, max_weight, timeout, clipped_bits=False):
        type(self).made.append((cfg, max_weight, timeout, clipped_bits))
        self.timeout, self.clipped_bits = timeout, clipped_bits

    def train_round(self, grid, messages, rnd):
        from flwr.app import ArrayRecord

        from pipeline.privacy.secure_aggregation import NodeOutcome, SecureRound

        nodes, total, mean, in_sum = {}, 0, None, set()
        for reply in grid.send_and_receive(messages, timeout=self.timeout):
            node = reply.metadata.src_node_id
            metrics = {**dict(reply.content["metrics"]), "secagg-clipped": 0}
            if grid.name(node) == self.lost_at_unmask:
                nodes[node] = NodeOutcome(metrics=metrics, failed_stage="unmask", error="gone", bytes_up=11)
                continue
            nodes[node] = NodeOutcome(metrics=metrics, bytes_down=7, bytes_up=13)
            w = int(metrics[N])
            state = reply.content["arrays"].to_torch_state_dict()
            mean = {k: w * v for k, v in state.items()} if mean is None else {k: mean[k] + w * state[k] for k in mean}
            total += w
            in_sum.add(node)
        arrays = ArrayRecord.from_torch_state_dict({k: v / total for k, v in mean.items()})
        return SecureRound(
            arrays=arrays,
            nodes=nodes,
            in_sum=in_sum,
            threshold=2,
            num_shares=3,
            clipped_count=0 if self.clipped_bits else None,
        )


def test_under_secure_aggregation_the_round_is_the_secure_sum_of_the_clients_in_it(ws, monkeypatch):
    """privacy.secure_aggregation: the server builds its SecAgg+ runner from the plan (secagg settings, the largest
    train split as the largest weight, every client, the round timeout) and takes the round's global from it; a
    client lost at unmask is failed and gets no weight share even though its metrics arrived."""
    from pipeline.federation.protocol import load_plan
    from pipeline.privacy import seam

    path = _secure_plan("loop-secure", fraction_train=1.0)
    monkeypatch.setattr(seam, "SecureAggregator", _InTheClearSecure)
    _InTheClearSecure.made = []
    script = Script()
    final, history, _ = run(path, script, timeout=4.5)
    plan = load_plan(path)
    partition = json.loads(Path(plan.paths["partition"]).read_text())
    largest = max(len(c["train"]) for c in partition["clients"].values())
    assert _InTheClearSecure.made == [(plan.privacy.secagg, largest, 4.5, False)]
    rows = rows_of(history, 1)
    assert rows["Product"]["failed"] == 1 and rows["Product"]["error"] == "SecAgg+ unmask: gone"
    assert "weight_share" not in rows["Product"] and rows["Product"]["bytes_up"] == 11
    assert rows["Academic"]["weight_share"] == pytest.approx(1 / 3) and rows["Committee"]["bytes_up"] == 13
    assert_state(
        final,
        {k: v + weighted_update(["Academic", "Committee"], script) for k, v in initial(path).items()},
        exact=False,
    )


def _secure_plan(
    name: str, method: str = "fedavg", partition: str = "domain/seed0", privacy: dict | None = None, **train
) -> str:
    from pipeline.common.config import from_dict
    from pipeline.experiments.privacy import PrivacyConfig

    path = write_plan(name, method, partition, **{"rounds": 1, **train})
    raw = json.loads(Path(path).read_text())
    raw["privacy"] = from_dict(PrivacyConfig, {"secure_aggregation": True, **(privacy or {})}, "privacy").plan_dict()
    Path(path).write_text(json.dumps(raw, indent=2, sort_keys=True))
    return path


def test_under_secure_aggregation_with_client_dp_the_mean_is_uniform_and_released_by_the_dp_wrapper(ws, monkeypatch):
    """Client-level DP under SecAgg+ (noise 0, C large): the runner sums 0/1 weights (max weight 1) with the
    clipped bits, the wrapper releases the uniform mean of the clients in the sum."""
    from pipeline.federation.protocol import load_plan
    from pipeline.privacy import seam

    path = _secure_plan(
        "loop-secure-cdp",
        fraction_train=1.0,
        privacy={"mode": "client", "noise_multiplier": 0.0, "clipping_norm": 1e6, "clipping_side": "client"},
    )
    monkeypatch.setattr(seam, "SecureAggregator", _InTheClearSecure)
    _InTheClearSecure.made = []
    script = Script(weight={c: 1 for c in WEIGHTS})  # clients under client-level DP report weight 1
    final, history, _ = run(path, script, timeout=4.5)
    assert _InTheClearSecure.made == [(load_plan(path).privacy.secagg, 1, 4.5, True)]
    assert rows_of(history, 1)["Product"]["failed"] == 1
    uniform = (DELTAS["Academic"] + DELTAS["Committee"]) / 3  # the sum over the expected count (3 of 3)
    assert_state(final, {k: v + uniform for k, v in initial(path).items()}, exact=False)


def test_a_secure_round_of_fewer_than_two_existing_clients_is_refused(ws):
    """post_addition: the late client is not in the first rounds' sums, so 3 existing clients x 0.5 sample one."""
    from pipeline.federation.server_app import run_server

    path = _secure_plan(
        "loop-secure-few",
        "post_addition",
        "extreme/seed0",
        fraction_train=0.5,
        rounds=2,
        join={"min_rel_improvement": 0.01, "patience": 1, "max_round": 2},
    )
    clients = ["Academic", "Committee", "Product", "SAMSum"]
    grid = Grid(path, Script(), clients)
    with pytest.raises(ValueError) as err:
        run_server(grid, path, Recorder(grid), round_timeout_s=4.5, ckpt=None)
    names(err.value, "loop-secure-few", "privacy.secure_aggregation", "train.fraction_train 0.5")


def test_nodes_that_know_no_plan_are_identified_through_the_plan_the_server_names(ws):
    """A node's config may hold its name and no plan: the identify message names the plan; a node that cannot name
    itself fails identification with its reason."""
    from pipeline.federation.admission import identify_clients
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import InProcessGrid, _set_server_identity

    path = write_plan("loop-identify-ids", "fedavg", rounds=1)
    grid = InProcessGrid(client_app, [{"client-name": n} for n in ("Product", "Academic", "Committee")])
    _set_server_identity(grid.run.run_id)
    assert identify_clients(grid, path, expected=["Academic", "Committee", "Product"], timeout=5) == {
        1000: "Product",
        1001: "Academic",
        1002: "Committee",
    }
    broken = InProcessGrid(client_app, [{"client-name": "Academic"}, {"plan": path}])
    _set_server_identity(broken.run.run_id)
    with pytest.raises(RuntimeError) as err:
        identify_clients(broken, path, expected=["Academic", "Committee"], timeout=5)
    assert str(err.value).startswith("node 1001 failed to identify:")
    assert "ValueError in client node 1001's query.identify" in str(err.value)  # the rest: in its log


@pytest.mark.parametrize("fraction, ok", [(0.67, True), (0.5, False)])
def test_a_secure_round_needs_two_existing_clients_in_every_sum_and_two_are_enough(ws, fraction, ok):
    """3 clients x 0.67 sample 2 per round: SecAgg+ can hide each upload in a sum of two; x 0.5 samples 1."""
    from pipeline.federation.protocol import load_plan
    from pipeline.privacy.seam import secure_aggregator as _secure_aggregator

    plan = load_plan(_secure_plan(f"loop-secure-{fraction}", "fedavg", fraction_train=fraction, rounds=1))
    clients = ["Academic", "Committee", "Product"]
    if ok:
        assert _secure_aggregator(plan, clients, None, 5.0) is not None
    else:
        with pytest.raises(
            ValueError,
            match="needs at least 2 clients in every round's sum; 3 clients x train.fraction_train 0.5 samples 1",
        ):
            _secure_aggregator(plan, clients, None, 5.0)


@pytest.mark.parametrize("weight_by, cap, largest", [("trained", 2, 2), ("trained", None, 6), ("full", 2, 6)])
def test_secure_aggregations_integer_weights_follow_the_largest_weight_a_client_can_report(ws, weight_by, cap, largest):
    """Flower's integer weight of a client is n_i (Q // max_weight); under train.weight_by trained a client reports
    at most max_train_examples_per_client. Sized by the largest train split instead (6 here; in params.yaml's CPU
    profile QMSum's 593 against 16 trained each), equal weights got Q / 3 here (Q / 37 there): the error bound of
    the SecAgg+ mean (aggregation_error_bound) was 3x (37x) docs/privacy.md's ~2c/Q + 10uc for equal weights, and
    the measured error of 3 adapter uploads 1.1e-4 instead of 3.1e-6."""
    from pipeline.federation.protocol import load_plan
    from pipeline.privacy.seam import secure_aggregator as _secure_aggregator

    name = f"loop-secure-weights-{weight_by}-{cap}"
    plan = load_plan(_secure_plan(name, weight_by=weight_by, max_train_examples_per_client=cap))
    secure = _secure_aggregator(plan, ["Academic", "Committee", "Product"], None, 5.0)
    assert secure.scale == plan.privacy.secagg.quantization_range // largest


def test_a_hand_written_plan_asking_secure_aggregation_of_a_server_that_does_more_than_average_is_refused(ws):
    """The plan stage refuses it already; a plan file edited by hand is refused again by the server, naming the
    file and the reason."""
    import dataclasses

    from pipeline.experiments.privacy import secure_aggregation_refusal
    from pipeline.federation.protocol import load_plan
    from pipeline.privacy.seam import secure_aggregator as _secure_aggregator

    plan = load_plan(_secure_plan("loop-secure-fedopt", "fedavg", rounds=1))
    fedopt = dataclasses.replace(plan, method="fedopt")
    reason = secure_aggregation_refusal(fedopt.spec, fedopt.train.transfer_dtype, fedopt.privacy)
    assert reason is not None and "fedopt" in reason
    with pytest.raises(ValueError) as err:
        _secure_aggregator(fedopt, ["Academic", "Committee", "Product"], None, 5.0)
    names(err.value, str(plan.source), "privacy.secure_aggregation", "fedopt")


def test_a_hand_written_plan_of_client_level_dp_clipped_by_the_server_under_secure_aggregation_is_refused(ws):
    """Under SecAgg+ the server holds only the sum, so it cannot clip each update: client-level DP must clip on
    the client. The server checks the plan's privacy group, not only its method."""
    import dataclasses

    from pipeline.federation.protocol import load_plan
    from pipeline.privacy.seam import secure_aggregator as _secure_aggregator

    plan = load_plan(
        _secure_plan(
            "loop-secure-server-clip",
            "fedavg",
            rounds=1,
            privacy={"mode": "client", "noise_multiplier": 1.0, "clipping_norm": 1.0, "clipping_side": "client"},
        )
    )
    server_side = dataclasses.replace(plan, privacy=dataclasses.replace(plan.privacy, clipping_side="server"))
    with pytest.raises(ValueError) as err:
        _secure_aggregator(server_side, ["Academic", "Committee", "Product"], None, 5.0)
    assert str(err.value).startswith(
        f"{plan.source}: privacy.secure_aggregation: privacy.mode client needs clipping_side client under SecAgg+"
    )


# ----------------------------------------------------------------------------------------------- admission
def test_the_plan_declares_the_clients_of_its_partition_scheme(ws):
    """The plan stage writes the clients the server admits (from params, no data read): the domain scheme's are the
    QMSum domains, extreme adds SAMSum; a serverless method declares none."""
    from pipeline.federation.protocol import load_plan

    assert load_plan(write_plan("adm-plan", "fedavg")).clients == ["Academic", "Committee", "Product"]
    assert load_plan(write_plan("adm-plan-x", "fedavg", "extreme/seed0")).clients == [
        "Academic",
        "Committee",
        "Product",
        "SAMSum",
    ]
    assert load_plan(write_plan("adm-plan-single", "single")).clients is None


def test_a_node_naming_an_unknown_client_is_refused_and_the_missing_client_fails_the_run(ws, caplog):
    """A SuperNode configured with a misspelt client name ("Prodcut"): it is refused with one line naming the name
    and the plan; Product never joins, so the run fails after the admission timeout naming Product, before any
    round (no client trained)."""
    from pipeline.federation.admission import AdmissionError
    from pipeline.federation.server_app import run_server

    path = write_plan("adm-typo", "fedavg", rounds=1, fraction_train=1.0)
    script = Script()
    grid = Grid(path, script, ["Academic", "Committee", "Prodcut"])
    recorder = Recorder(grid)
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"), pytest.raises(AdmissionError) as err:
        run_server(grid, path, recorder, round_timeout_s=60, admission_timeout_s=0.5, ckpt=None)
    assert "['Product']" in str(err.value) and str(err.value).startswith(path)
    refusals = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(refusals) == 1 and "'Prodcut'" in refusals[0].getMessage() and path in refusals[0].getMessage()
    assert recorder.started_with is None and script.calls == []


def test_a_client_that_joins_within_the_admission_timeout_is_admitted_and_a_stranger_stays_out(ws, caplog):
    """A stranger connects first, Product's node a poll later: the run starts with the three declared clients and
    the stranger never gets a train message."""
    path = write_plan("adm-late", "fedavg", rounds=1, fraction_train=1.0)
    script = Script()
    grid = Grid(path, script, ["Academic", "Committee", "Product"], extra={5000: "Mallory"})
    polls = []
    every = grid.get_node_ids

    def product_late():
        polls.append(1)
        return [n for n in every() if len(polls) > 1 or grid.name(n) != "Product"]

    grid.get_node_ids = product_late
    _, history, recorder = run(path, script, grid=grid, timeout=30)
    assert recorder.started_with == (["Academic", "Committee", "Product"], 1)
    assert trained(script, 1) == ["Academic", "Committee", "Product"]
    assert sorted(r["client"] for r in history) == ["Academic", "Committee", "Product"]


def test_a_client_without_valid_examples_is_refused_at_admission(ws):
    """The real ClientApp reports its split sizes from its own partition slice when it identifies; a client with an
    empty valid split (no best round, no score) fails admission naming it, before round 1."""
    from pipeline.federation.admission import AdmissionError
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import InProcessGrid, _set_server_identity
    from pipeline.federation.server_app import run_server
    from pipeline.paths import PATHS

    partition = json.loads(PATHS.partition("domain/seed0").read_text())
    partition["clients"]["Committee"]["valid"] = []
    target = PATHS.partition("novalid/seed0")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(partition))
    path = write_plan("adm-novalid", "fedavg", "novalid/seed0", rounds=1)
    raw = json.loads(Path(path).read_text())
    Path(path).write_text(json.dumps({**raw, "clients": ["Academic", "Committee", "Product"]}))
    grid = InProcessGrid(client_app, [{"client-name": c, "plan": path} for c in ("Academic", "Committee", "Product")])
    _set_server_identity(grid.run.run_id)
    with pytest.raises(AdmissionError) as err:
        run_server(grid, path, Recorder(), round_timeout_s=30, ckpt=None)
    assert "'Committee'" in str(err.value) and "valid" in str(err.value)


def test_the_deployed_server_runs_without_any_partition_or_client_data(ws, tmp_path, monkeypatch, capsys):
    """The ServerApp (pipeline.federation.deployment.serve) started in a directory that holds only the plan and the
    backbone (for the round-0 adapter): no params file, no data/ and no site's files. The scripted clients report their
    weights through Flower messages; the run trains, writes rounds.json and metrics.json, and reads nothing under
    data/ (it only writes its run directory there)."""
    import shutil

    from flwr.app import Context, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID

    from pipeline.federation.deployment import serve

    plan_src = write_plan("srv-nodata", "fedavg", rounds=2, fraction_train=1.0)
    clients = ["Academic", "Committee", "Product"]
    script = Script(counts={c: {"num-train": WEIGHTS[c], "num-valid": 2} for c in clients})  # no partition here
    server = tmp_path / "server"
    (server / "models/plans").mkdir(parents=True)
    shutil.copy(plan_src, server / plan_src)
    shutil.copytree(ws / "models/backbone", server / "models/backbone")
    monkeypatch.chdir(server)
    monkeypatch.setenv("FEDMEET_ROOT", str(server))
    grid = Grid(plan_src, script, clients)
    result = serve(
        grid,
        Context(
            run_id=grid.run.run_id,
            node_id=SUPERLINK_NODE_ID,
            node_config={},
            state=RecordDict(),
            run_config={"plan": plan_src, "mlflow": False, "evaluate": False},
        ),
    )
    assert trained(script, 1) == trained(script, 2) == clients
    assert "srv-nodata: starting at round 1 of 2" in capsys.readouterr().out  # what `flwr run --stream` shows
    rows = json.loads((server / "models/srv-nodata/rounds.json").read_text())
    rows = rows["rounds"] if isinstance(rows, dict) else rows
    assert {r["client"] for r in rows} == set(clients) and result["eval"] is None
    data = server / "data"
    assert sorted(p.name for p in data.iterdir()) == ["cache"] and sorted(
        p.name for p in (data / "cache").iterdir()
    ) == ["runs"]


def test_federated_metrics_replace_an_earlier_evaluate_stages_files(tmp_path, monkeypatch):
    """A federated evaluation's folder holds only its own files: no per_example.parquet/predictions.jsonl of an
    earlier evaluate stage beside the fresh metrics.json; the run's own rounds.json stays when asked to."""
    from types import SimpleNamespace

    from pipeline.federation.deployment import write_eval_metrics

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "reports" / "eval" / "dep-stale"
    out.mkdir(parents=True)
    for name in ("per_example.parquet", "predictions.jsonl", "metrics.json", "rounds.json"):
        (out / name).write_text("old")
    plan = SimpleNamespace(experiment="dep-stale")
    write_eval_metrics(plan, {"mean": {"avg_rouge": 1.0}}, keep=("rounds.json",))
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "rounds.json"]
    assert (out / "rounds.json").read_text() == "old"
    assert json.loads((out / "metrics.json").read_text()) == {"mean": {"avg_rouge": 1.0}}
    write_eval_metrics(plan, {"mean": {"avg_rouge": 2.0}})
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json"]


def test_the_federated_evaluation_every_n_rounds_is_kept_on_disk_without_mlflow(ws, monkeypatch):
    """Run config evaluate-every=2, mlflow=false: rounds 2 and 4 of a 5-round plan are evaluated on the clients
    (not 5: the final evaluation is metrics.json's) and both land in reports/eval/<exp>/rounds.json."""
    from types import SimpleNamespace

    from pipeline.federation import deployment
    from pipeline.federation.protocol import load_plan
    from pipeline.paths import PATHS

    plan = load_plan(write_plan("dep-every-disk", "fedavg", rounds=5))
    asked = []

    def evaluate(grid, plan_, plan_path, cfg, timeout, nodes=None, clients=None):
        asked.append(len(asked) + 1)
        return {
            "clients": {"Academic": {"avg_rouge": float(len(asked))}},
            "skipped_clients": {},
            "mean": {"avg_rouge": float(len(asked))},
            "failed_clients": {},
        }

    monkeypatch.setattr(deployment, "federated_evaluate", evaluate)
    monkeypatch.setattr(deployment.TrainRecorder, "round_done", lambda *a: None)  # the train stage's part
    recorder = deployment.DeploymentRecorder(None, None, "p.json", object(), 2, 5.0)
    for rnd in range(1, 6):
        recorder.round_done(plan, SimpleNamespace(round=rnd), [])
    saved = json.loads((PATHS.eval_dir("dep-every-disk") / "rounds.json").read_text())
    assert [r["round"] for r in saved["rounds"]] == [2, 4]
    assert [r["mean"]["avg_rouge"] for r in saved["rounds"]] == [1.0, 2.0]


def test_a_resumed_run_keeps_the_federated_evaluations_of_its_rounds_before_the_kill(ws, monkeypatch):
    """evaluate-every=1 on a 5-round plan, killed after round 2 and resumed at round 3: reports/eval/<exp>/rounds.json
    holds the evaluations of rounds 1 to 4 (the resumed run does not train rounds 1-2 again, so it cannot score them
    again: overwriting the file with its own rounds only loses them)."""
    from types import SimpleNamespace

    from pipeline.federation import deployment
    from pipeline.federation.protocol import load_plan
    from pipeline.paths import PATHS

    plan = load_plan(write_plan("dep-every-resume", "fedavg", rounds=5))

    def evaluate(grid, plan_, plan_path, cfg, timeout, nodes=None, clients=None):
        return {"clients": {}, "skipped_clients": {}, "mean": {"avg_rouge": 1.0}, "failed_clients": {}}

    monkeypatch.setattr(deployment, "federated_evaluate", evaluate)
    monkeypatch.setattr(deployment.TrainRecorder, "round_done", lambda *a: None)  # the train stage's part
    for start, stop in ((1, 2), (3, 4)):  # the killed attempt, then the resumed one (a new ServerApp process)
        recorder = deployment.DeploymentRecorder(None, None, "p.json", object(), 1, 5.0)
        recorder.started(plan, ["Academic"], start)
        for rnd in range(start, stop + 1):
            recorder.round_done(plan, SimpleNamespace(round=rnd), [])
        recorder.close()
    saved = json.loads((PATHS.eval_dir("dep-every-resume") / "rounds.json").read_text())
    assert [r["round"] for r in saved["rounds"]] == [1, 2, 3, 4]


def test_a_client_that_fails_every_round_fails_the_deployed_run_naming_it(ws, tmp_path, monkeypatch):
    """A hung node (no reply within the round timeout, every round): the rounds are recorded, then the ServerApp
    fails naming the client and its error, so `flwr run`'s status (and the local command) is non-zero; a client
    that failed some rounds only does not fail the run."""
    from flwr.app import Context, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID

    from pipeline.federation.deployment import never_contributed, serve

    path = write_plan("srv-hung", "fedavg", rounds=2, fraction_train=1.0)
    grid = Grid(path, Script(), ["Academic", "Committee", "Product"])
    grid.lost = {("Product", 1), ("Product", 2)}
    with pytest.raises(RuntimeError) as err:
        serve(
            grid,
            Context(
                run_id=grid.run.run_id,
                node_id=SUPERLINK_NODE_ID,
                node_config={},
                state=RecordDict(),
                run_config={"plan": path, "mlflow": False, "evaluate": False, "round-timeout-s": 2.0},
            ),
        )
    assert "['Product']" in str(err.value) and "no reply within 2s" in str(err.value)
    rows = [
        {"round": 1, "client": "A", "sampled": 1, "failed": 1, "error": "x"},
        {"round": 2, "client": "A", "sampled": 1, "failed": 0},
        {"round": 1, "client": "B", "sampled": 0},
    ]
    assert never_contributed(rows) == {}


def test_a_retry_after_a_failed_admission_deletes_the_dead_mlflow_run_and_keeps_one_run(ws):
    """A ServerApp whose admission fails (a declared client never joins) ends its MLflow run KILLED and leaves its
    id without a server checkpoint; the retry deletes that run (it holds no round) instead of leaving a dead
    attempt in the runs table, and records one run of its own."""
    from flwr.app import Context, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from mlflow.tracking import MlflowClient

    from pipeline.federation.admission import AdmissionError
    from pipeline.federation.deployment import serve
    from pipeline.federation.protocol import load_plan
    from pipeline.training import checkpoints

    path = write_plan("srv-retry", "fedavg", rounds=1, fraction_train=1.0)
    plan = load_plan(path)
    run_config = {"plan": path, "evaluate": False, "admission-timeout-s": 0.5}

    def attempt(clients):
        grid = Grid(path, Script(), clients)
        return serve(
            grid,
            Context(
                run_id=grid.run.run_id,
                node_id=SUPERLINK_NODE_ID,
                node_config={},
                state=RecordDict(),
                run_config=run_config,
            ),
        )

    with pytest.raises(AdmissionError):
        attempt(["Academic", "Committee"])  # Product never joins
    id_file = checkpoints.mlflow_run_id_path(plan)
    dead = id_file.read_text().strip()
    assert not checkpoints.server_checkpoint_path(plan).exists()
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    assert client.get_run(dead).info.status == "KILLED"
    attempt(["Academic", "Committee", "Product"])
    assert client.get_run(dead).info.lifecycle_stage == "deleted"
    experiment = client.get_experiment_by_name(plan.study)
    runs = client.search_runs([experiment.experiment_id], "tags.experiment = 'srv-retry'")
    assert [r.info.status for r in runs] == ["FINISHED"] and runs[0].info.run_id != dead
    assert not id_file.exists()


def test_a_deployed_run_killed_between_a_rounds_checkpoint_and_its_logging_logs_that_round_when_resumed(
    ws, monkeypatch
):
    """Every round of a run is in its MLflow run (history.ROUND_METRIC at each step), as the train stage's resumed run
    back-fills it: killed after round 1's checkpoint (before its metrics are logged), the resumed ServerApp does not
    train round 1 again, so it must log it."""
    from flwr.app import Context, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from mlflow.tracking import MlflowClient

    from pipeline.federation.deployment import serve

    path = write_plan("srv-backfill", "fedavg", rounds=2, fraction_train=1.0)

    def attempt():
        grid = Grid(path, Script(), ["Academic", "Committee", "Product"])
        run_config = {"plan": path, "evaluate": False}
        context = Context(grid.run.run_id, SUPERLINK_NODE_ID, {}, RecordDict(), run_config)
        return serve(grid, context)

    with killed_after_checkpoint(monkeypatch, 1):
        attempt()
    attempt()
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("tests")
    (run,) = client.search_runs([experiment.experiment_id], "tags.experiment = 'srv-backfill'")
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "bytes_sent")) == [1, 2]


def test_a_serverapp_refusing_its_decoding_leaves_no_mlflow_run_running(ws):
    """A run config whose decoding is refused (one line naming it) fails the ServerApp before any round: its MLflow run,
    if it started one, must not stay RUNNING (docs/federation.md: a failed attempt leaves its run KILLED)."""
    from flwr.app import Context, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from mlflow.tracking import MlflowClient

    from pipeline.common.config import ConfigError
    from pipeline.federation.deployment import serve

    path = write_plan("srv-bad-decoding", "fedavg", rounds=1, fraction_train=1.0)
    grid = Grid(path, Script(), ["Academic", "Committee", "Product"])
    run_config = {"plan": path, "decoding": json.dumps({"num_beams": "x"})}
    with pytest.raises(ConfigError, match="decoding"):
        serve(grid, Context(grid.run.run_id, SUPERLINK_NODE_ID, {}, RecordDict(), run_config))
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("tests")
    runs = client.search_runs([experiment.experiment_id], "tags.experiment = 'srv-bad-decoding'") if experiment else []
    assert [r.info.status for r in runs if r.info.status == "RUNNING"] == []


@pytest.mark.parametrize(
    "method, extra",
    [
        ("fedavg", {}),
        ("fedopt", {"fedopt": {"server_optimizer": "adam", "server_lr": 0.1}}),
        ("fedopt", {"fedopt": {"server_optimizer": "sgdm", "server_lr": 1.0}}),
        ("fednova", {}),
    ],
)
def test_clients_returning_what_they_received_leave_every_strategy_at_the_lossy_downlink(ws, method, extra):
    """int8: the clients train from the decoded downlink q(W), not the server's W. Every client returning what it
    received is a zero update: a zero pseudo-gradient for FedOpt, zero Delta_i for FedNova (its docstring takes them
    against what was sent), so after each round the global is what the clients received, as under FedAvg. Taking
    the updates against W instead makes q(W) - W a step (Adam: ~server_lr per coordinate; FedNova with unequal
    steps: (tau_eff sum p_i / tau_i - 1) (q(W) - W))."""
    from pipeline.federation.compression import decode_state, encode_state

    name = f"loop-noop-{method}-{extra.get('fedopt', {}).get('server_optimizer', '')}"
    path = write_plan(name, method, rounds=2, fraction_train=1.0, transfer_dtype="int8", **extra)
    script = Script(delta={c: 0.0 for c in DELTAS})
    final, history, _ = run(path, script)
    assert all(r["failed"] == 0 for r in history)
    received = decode_state(encode_state(initial(path), "int8"))  # q(W0); q(q(W0)) = q(W0): same scale, integers
    assert any(not torch.equal(received[k], v) for k, v in initial(path).items())  # the downlink is lossy
    for got in [state for kind, _, _, state in script.calls if kind == "train"]:
        assert_state(got, received, exact=False)
    assert_state(final, received, exact=False)


def test_fedadams_float64_global_sent_as_fp32_is_the_reference_of_the_next_pseudo_gradient(ws, monkeypatch):
    """Flower's FedAdam returns a float64 global (its bias-corrected step size is a NumPy float64), which fp32 sends
    rounded to float32: the clients train from fl32(W), so, as under a lossy downlink, the next round's
    pseudo-gradient is taken against what they received (Flower's FedOpt keeps it as current_arrays), not W."""
    from pipeline.federation import server_app
    from pipeline.federation.protocol import load_plan

    built = []
    real = server_app.build_strategy
    monkeypatch.setattr(server_app, "build_strategy", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    adam = {"server_optimizer": "adam", "server_lr": 0.1}
    path = write_plan("loop-fp32-fedadam", "fedopt", rounds=2, fraction_train=1.0, fedopt=adam)
    script = Script()
    final, _, _ = run(path, script)
    assert load_plan(path).train.transfer_dtype == "fp32" and built[0].v_t  # FedAdam stepped
    received = [state for kind, _, rnd, state in script.calls if kind == "train" and rnd == 2]
    assert len(received) == 3 and all(v.dtype == torch.float32 for v in received[0].values())
    reference = built[0].current_arrays  # round 2's, the last configure_train's
    assert reference.keys() == received[0].keys()
    for k, v in received[0].items():
        np.testing.assert_array_equal(reference[k], v.numpy(), err_msg=k)


def test_fedadams_float64_global_is_kept_saved_and_returned_as_the_float32_the_clients_decode(ws, monkeypatch):
    """Flower's FedAdam returns a float64 W; the global the server keeps (its round checkpoint, what run_server
    returns: the deployed global_adapter.safetensors, MLflow's "global" model) is the model's float32, the rounding
    of Flower's W, bit for bit what fp32 sends the clients (it was float64: twice the size, other bytes)."""
    from flwr.serverapp import strategy as fs

    from pipeline.federation.protocol import load_plan
    from pipeline.training import checkpoints

    globals_ = []
    real = fs.FedAdam.aggregate_train
    monkeypatch.setattr(fs.FedAdam, "aggregate_train", lambda *a: globals_.append(real(*a)) or globals_[-1])
    adam = {"server_optimizer": "adam", "server_lr": 0.1}
    path = write_plan("loop-fp32-fedadam-saved", "fedopt", rounds=2, fraction_train=1.0, fedopt=adam)
    script = Script()
    final, _, _ = run(path, script)
    flower = [{k: a.numpy() for k, a in arrays.items()} for arrays, _ in globals_]
    assert len(flower) == 2 and {v.dtype for w in flower for v in w.values()} == {np.dtype(np.float64)}
    assert {v.dtype for v in initial(path).values()} == {torch.float32}
    ckpt = checkpoints.load_round_checkpoint(checkpoints.server_checkpoint_path(load_plan(path)), load_plan(path))
    received = [state for kind, _, rnd, state in script.calls if kind == "train" and rnd == 2][0]
    for k, w in flower[1].items():
        assert final[k].dtype == ckpt["arrays"][k].dtype == torch.float32, k
        np.testing.assert_array_equal(final[k].numpy(), w.astype(np.float32), err_msg=k)
        np.testing.assert_array_equal(ckpt["arrays"][k].numpy(), w.astype(np.float32), err_msg=k)
        np.testing.assert_array_equal(received[k].numpy(), flower[0][k].astype(np.float32), err_msg=k)


def test_fedavgm_takes_every_rounds_pseudo_gradient_against_the_lossy_downlink_not_only_the_first(ws):
    """int8, FedAvgM (server_lr 0.5, momentum 0.9), 3 rounds of constant client updates: by hand, each round
    the clients get s = q(W), return s + delta_c, the pseudo-gradient is g = s - sum_c p_c reply_c, m = g (round 1) or
    0.9 m + g, and W <- s - 0.5 m. Flower's FedAvgM keeps the first round's arrays as its reference and then its
    own exact aggregate W, so from round 2 on q(W) - W entered g as if the clients had moved it."""
    from pipeline.federation.protocol import decode_global, decode_reply, encode_global, encode_reply, load_plan

    fedopt = {"server_optimizer": "sgdm", "server_lr": 0.5, "server_momentum": 0.9}
    path = write_plan(
        "loop-lossy-fedavgm", "fedopt", rounds=3, fraction_train=1.0, transfer_dtype="int8", fedopt=fedopt
    )
    final, _, _ = run(path, Script())
    plan, clients = load_plan(path), ["Academic", "Committee", "Product"]
    p = {c: WEIGHTS[c] / sum(WEIGHTS[c] for c in clients) for c in clients}
    w, m = {k: v.double() for k, v in initial(path).items()}, None
    for _ in range(3):
        sent = decode_global(encode_global({k: v.float() for k, v in w.items()}, plan), plan)
        replies = {c: encode_reply({k: v + DELTAS[c] for k, v in sent.items()}, plan, sent) for c in clients}
        replies = {c: decode_reply(r, plan, sent).to_torch_state_dict() for c, r in replies.items()}
        g = {k: sent[k].double() - sum(p[c] * replies[c][k].double() for c in clients) for k in sent}
        m = g if m is None else {k: 0.9 * m[k] + g[k] for k in g}
        w = {k: sent[k].double() - 0.5 * m[k] for k in g}
    assert_state(final, w, exact=False)
