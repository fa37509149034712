"""SecAgg+ (privacy.secure_aggregation, pipeline/privacy/secure_aggregation.py): the unmasked aggregate against the
plain weighted mean of the same uploads within the quantisation bound, what a client's masked reply holds, dropped
clients and the reconstruction threshold, the refusals, the `privacy.secagg` group and the plans.

The bound (pipeline.privacy.secure_aggregation.aggregation_error_bound, derived from Flower's quantiser): with
clipping range c, quantisation range Q, k clients in the sum, Flower's integer weights q_i = n_i * (Q // max n) and
m the largest |upload|, |SecAgg+ mean - FedAvg mean| <= k (Q / sum q_i)(2c/Q + 10uc) + (k + 3) u m, u = 2**-24.
"""

from __future__ import annotations

import io
import json
import logging
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.secure_aggregation import max_abs, max_diff, weighted_mean
from pipeline.common.config import ConfigError, from_dict
from pipeline.experiments.privacy import PrivacyConfig, SecAggConfig
from tests.errors import logs, names
from tests.test_federated import workspace, ws  # noqa: F401  (fixtures)
from tests.test_privacy import _params, _write_plan

N_TRAIN = {"Academic": 4, "Committee": 6, "Product": 5}  # the domain partition of tests/test_federated.py
SECURE = {"secure_aggregation": True}


# ------------------------------------------------------------------------------------------ the bound
def test_bound_is_the_documented_formula_for_a_hand_computed_case():
    from pipeline.privacy.secure_aggregation import SecureAggregator, aggregation_error_bound

    cfg = SecAggConfig(clipping_range=8.0, quantization_range=2**22)
    assert SecureAggregator(cfg, 10, 1.0).scale == 419430  # 4194304 // 10
    # k = 3, weights 3 + 7 + 10 = 20, sum q = 419430 * 20 = 8388600, m = 8:
    # 3 * (4194304 / 8388600) * (16 / 4194304 + 10 * 8 / 2**24) + 6 * 8 / 2**24
    expected = 3 * 0.5000004768 * (3.814697265625e-06 + 4.76837158203125e-06) + 2.86102294921875e-06
    assert aggregation_error_bound([3, 7, 10], 419430, cfg, 8.0) == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match="below the largest client weight 5000"):
        SecureAggregator(SecAggConfig(quantization_range=4096), 5000, 1.0)


def test_client_level_noise_under_secagg_covers_what_a_quantised_upload_adds():
    """Under client-level DP a client moves the unmasked sum by its upload as Flower quantises it: the clipped
    update (norm C) plus a stochastic rounding of up to a step 2c/Q per coordinate, whose norm grows with sqrt(d).
    The Gaussian mechanism's noise must be calibrated to that sensitivity (Dwork and Roth 2014, Thm 3.22; Kairouz
    et al. 2021 bound the norm after rounding), not to C alone: std >= z x (largest move) / m."""
    from flwr.app import Array, ArrayRecord
    from flwr.common.secure_aggregation.quantization import dequantize, quantize

    from pipeline.privacy.accounting import federation_privacy
    from pipeline.privacy.client_dp import ClientLevelDP

    cfg, (c, d, z, m) = SecAggConfig(), (3e-4, 40_000, 2.0, 3)
    rng = np.random.default_rng(0)
    w = rng.uniform(-0.5, 0.5, d).astype(np.float32)
    update = rng.normal(size=d)
    upload = (w + update * c / np.linalg.norm(update)).astype(np.float32)  # W + clip(W_i - W), ||.|| = C
    np.random.seed(0)  # Flower's rounding draws from numpy's global generator
    back = dequantize(quantize([upload], cfg.clipping_range, cfg.quantization_range), cfg.clipping_range, 2**22)[0]
    moved = float(np.linalg.norm(back - w.astype(np.float64)))
    assert moved > 1.2 * c  # one client moves the sum by more than C

    privacy = PrivacyConfig(mode="client", noise_multiplier=z, clipping_norm=c, clipping_side="client", **SECURE)
    dp = ClientLevelDP(
        SimpleNamespace(), SimpleNamespace(privacy=privacy, seed=0), federation_privacy(privacy, 3, m, 5)
    )
    dp._arrays = ArrayRecord({"w": Array(w)})
    released = dp.release_secure_mean(1, ArrayRecord({"w": Array(w)}), 0, m)["w"].numpy()
    assert (released.astype(np.float64) - w).std() >= 0.98 * z * moved / m  # 0.98: the sample std of 40000 draws


@pytest.mark.parametrize("clipping_range,quantization_range", [(8.0, 2**22), (1.0, 2**12)])
def test_secagg_sum_equals_the_plain_sum_within_the_quantisation_bound(clipping_range, quantization_range):
    from flwr.common import bytes_to_ndarray

    from benchmarks.secure_aggregation import plain_fedavg, secure_round
    from pipeline.privacy.secure_aggregation import aggregation_error_bound

    np.random.seed(0)  # Flower's stochastic rounding draws from numpy's global generator
    rng = np.random.default_rng(1)
    c = clipping_range
    weights = {"a": 3, "b": 7, "c": 10}
    # uniform over the whole clipping range (no coordinate clipped: |x| n / max n <= c), a LayerNorm-like block
    uploads = {
        n: {
            "w": (rng.uniform(-c, c, size=(40, 25)) * 0.999).astype(np.float32),
            "ln": (1.0 + 0.1 * rng.standard_normal(30)).clip(-c, c).astype(np.float32),
        }
        for n in weights
    }
    cfg = SecAggConfig(clipping_range=c, quantization_range=quantization_range)
    secure, result, replies = secure_round(uploads, weights, cfg)

    assert result.halted is None and result.in_sum == set(result.nodes) and len(result.nodes) == 3
    got = {k: a.numpy() for k, a in result.arrays.items()}
    states, w = [uploads[n] for n in weights], list(weights.values())
    bound = aggregation_error_bound(w, secure.scale, cfg, max_abs(states))
    exact = weighted_mean(states, w)
    plain = plain_fedavg(uploads, weights)
    assert max_diff(got, plain) <= bound
    assert max_diff(got, exact) <= bound
    # the quantisation really happened (a plain mean would sit at float32 rounding, far below one step)
    assert max_diff(got, exact) > 0.1 * 2 * c / quantization_range

    # the server saw no upload: each masked vector is the upload plus masks, nowhere near the upload itself
    collect = [r for r in replies if "fitres.metrics" in r.content.config_records]
    assert len(collect) == 3
    for r in collect:
        assert all(len(rec) == 0 for rec in r.content.array_records.values())  # the mod cleared the arrays
        masked = [bytes_to_ndarray(b) for b in r.content.config_records["secaggplus_configs"]["masked_params"]]
        assert len(masked) == 1 + len(uploads["a"])  # the masked integer weight, then one vector per tensor
        # a quantised upload lies in [0, Q]; masked, its entries spread over [0, 2**32)
        assert float(np.mean(masked[1] > quantization_range)) > 0.9


# ------------------------------------------------------------------------------------------ on the model
def _inside(function) -> bool:
    """Whether ``function`` is on the current call stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is function.__code__:
            return True
        frame = frame.f_back
    return False


def _spy_uploads(monkeypatch) -> dict[tuple[int, str], tuple[dict[str, np.ndarray], int, bool, dict[str, np.ndarray]]]:
    """(round, client) -> (the adapter the client's train round produced (before any client-level DP clipping),
    its weight, masked?, the global adapter it received)."""
    from pipeline.federation import client_app
    from pipeline.privacy.secure_aggregation import legacy_fit

    seen = {}
    real = client_app.train_round

    def spy(msg, context):
        reply = real(msg, context)
        masked = _inside(legacy_fit)  # called by SecAgg+'s masked-vector stage: the reply leaves only masked
        rnd = int(msg.content["config"]["server-round"])
        name = client_app.client_name(context)
        seen[(rnd, name)] = (
            {k: a.numpy().copy() for k, a in reply.content["arrays"].items()},
            int(reply.content["metrics"]["num-examples"]),
            masked,
            {k: a.numpy().copy() for k, a in msg.content["arrays"].items()},
        )
        return reply

    monkeypatch.setattr(client_app, "train_round", spy)
    return seen


def _spy_globals(monkeypatch) -> dict[int, dict[str, np.ndarray]]:
    """round -> the global adapter the server checkpointed after it."""
    from pipeline.federation import server_app

    seen = {}
    real = server_app.save_server_checkpoint

    def spy(plan, rnd, state, *args, **kwargs):
        seen[rnd] = {k: t.numpy().copy() for k, t in state.items()}
        return real(plan, rnd, state, *args, **kwargs)

    monkeypatch.setattr(server_app, "save_server_checkpoint", spy)
    return seen


def _check_rounds_against_uploads(uploads, globals_, rounds, in_sum) -> list[float]:
    """Every round's unmasked global against the exact FedAvg of the uploads of the clients ``in_sum(rnd)``."""
    from pipeline.privacy.secure_aggregation import SecureAggregator, aggregation_error_bound

    cfg = SecAggConfig()
    scale = SecureAggregator(cfg, max(N_TRAIN.values()), 1.0).scale
    diffs = []
    for rnd in rounds:
        states = [uploads[(rnd, c)][0] for c in in_sum(rnd)]
        weights = [uploads[(rnd, c)][1] for c in in_sum(rnd)]
        assert all(uploads[(rnd, c)][2] for c in in_sum(rnd))  # every upload went through SecAgg+
        diff = max_diff(globals_[rnd], weighted_mean(states, weights))
        assert diff <= aggregation_error_bound(weights, scale, cfg, max_abs(states)), rnd
        diffs.append(diff)
    return diffs


def _spy_masked_vector_replies(monkeypatch) -> list:
    """The masked-vector replies the server pulls, each with its train metrics as they arrived: read at the pull,
    before the server's observer hands Flower an empty copy of the record (secure_aggregation._ObservedGrid)."""
    from pipeline.federation import engines

    replies, real_pull = [], engines.InProcessGrid.pull_messages

    def pull(self, ids):
        pulled = list(real_pull(self, ids))
        for r in pulled:
            if r.has_content() and "fitres.metrics" in r.content.config_records:
                replies.append((r, dict(r.content.config_records["fitres.metrics"])))
        return pulled

    monkeypatch.setattr(engines.InProcessGrid, "pull_messages", pull)
    return replies


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["fedavg", "fedselectkd"])
def test_secure_run_unmasks_the_weighted_mean_of_the_uploads_and_matches_the_plain_run(ws, monkeypatch, method):
    import mlflow

    from pipeline.federation.protocol import TRAIN_METRICS
    from pipeline.privacy.secure_aggregation import SecureAggregator, aggregation_error_bound
    from pipeline.train import run_experiment

    uploads, globals_ = _spy_uploads(monkeypatch), _spy_globals(monkeypatch)
    replies = _spy_masked_vector_replies(monkeypatch)
    name = f"sa-{method}"
    metrics = run_experiment(_write_plan(name, method, SECURE))
    _check_rounds_against_uploads(uploads, globals_, (1, 2), lambda rnd: list(N_TRAIN))

    # what left the clients: no adapter array, the train metrics and the count of clipped coordinates
    assert len(replies) == 2 * len(N_TRAIN)
    for r, sent in replies:
        assert all(len(rec) == 0 for rec in r.content.array_records.values())
        assert set(sent) == set(TRAIN_METRICS) | {"secagg-clipped"}
        assert all(isinstance(v, (int, float)) for v in sent.values())
        assert dict(r.content.config_records["fitres.status"]) == {"code": 0, "message": ""}
    history = json.loads(Path(f"models/{name}/rounds.json").read_text())
    assert all(r["sampled"] == 1 and r["failed"] == 0 and r["secagg_clipped"] == 0 for r in history)
    assert metrics["secure_aggregation"] == {
        "protocol": "SecAgg+ (flwr SecAggPlusWorkflow)",
        "num_shares": 1.0,
        "reconstruction_threshold": 0.67,
        "clipping_range": 8.0,
        "quantization_range": 2**22,
        "rounds_aggregated": 2,
        "dropped": {},
        "clipped_coordinates": 0,
    }
    assert json.loads(Path(f"reports/train/{name}/metrics.json").read_text())["secure_aggregation"]["dropped"] == {}
    mlflow.set_tracking_uri(__import__("os").environ["MLFLOW_TRACKING_URI"])
    run = mlflow.search_runs(experiment_names=["tests-privacy"], filter_string=f"tags.experiment = '{name}'").iloc[0]
    assert run["params.privacy.secure_aggregation"] == "True" and run["params.privacy.secagg.clipping_range"] == "8.0"
    assert run["metrics.secagg.clipped_coordinates"] == 0 and run["metrics.secagg.rounds_aggregated"] == 2

    # The plain run: round 1 trains on the same inputs, so the uploads are identical bit for bit and the two
    # round-1 aggregates differ only by SecAgg+'s quantisation.
    secure_uploads, secure_round1 = dict(uploads), globals_[1]
    uploads.clear()
    plain = run_experiment(_write_plan(f"plain-{method}", method, None), track=False)
    for c in N_TRAIN:
        assert not uploads[(1, c)][2]
        for k, v in uploads[(1, c)][0].items():
            np.testing.assert_array_equal(v, secure_uploads[(1, c)][0][k])
    states = [uploads[(1, c)][0] for c in N_TRAIN]
    bound = aggregation_error_bound(
        list(N_TRAIN.values()), SecureAggregator(SecAggConfig(), 6, 1.0).scale, SecAggConfig(), max_abs(states)
    )
    assert max_diff(secure_round1, globals_[1]) <= bound
    assert "secure_aggregation" not in plain
    # masked int64 vectors, keys and shares: more bytes up than the fp32 adapter
    plain_rows = json.loads(Path(f"models/plain-{method}/rounds.json").read_text())
    assert sum(r["bytes_up"] for r in history) > sum(r["bytes_up"] for r in plain_rows)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("method,partition", [("fedprox", "domain/seed0"), ("post_addition", "extreme/seed0")])
def test_the_other_averaging_methods_run_under_secure_aggregation(ws, monkeypatch, method, partition):
    # fedprox: the proximal term is the client's; post_addition: SAMSum joins in round 2 (train.join.max_round),
    # so round 2's sum has one more client
    from pipeline.planning import parse_entry, resolve_plan
    from pipeline.train import run_experiment

    uploads, globals_ = _spy_uploads(monkeypatch), _spy_globals(monkeypatch)
    params = _params(SECURE)
    entry = parse_entry(f"sa-{method}", {"method": method, "partition": partition, "study": "tests-privacy"}, params)
    path = Path(f"models/plans/sa-{method}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(resolve_plan(entry, params)))
    metrics = run_experiment(str(path), track=False)
    in_round = {rnd: sorted(c for r, c in uploads if r == rnd) for rnd in (1, 2)}
    if method == "post_addition":
        assert in_round == {1: sorted(N_TRAIN), 2: sorted([*N_TRAIN, "SAMSum"])}
    _check_rounds_against_uploads(uploads, globals_, (1, 2), in_round.get)
    assert metrics["secure_aggregation"]["rounds_aggregated"] == 2 and metrics["secure_aggregation"]["dropped"] == {}


def test_fewer_than_two_clients_per_round_is_refused(ws):
    from pipeline.train import run_experiment

    with pytest.raises(
        ValueError,
        match=r"needs at least 2 clients in every round's sum; 3 clients x "
        r"train.fraction_train 0.34 samples 1$",
    ):
        run_experiment(_write_plan("sa-one", "fedavg", SECURE, fraction_train=0.34), track=False)


@pytest.mark.parametrize(
    "secagg,fraction_train,names_key",
    [
        ({}, 0.34, "train.fraction_train 0.34 samples 1"),  # max(int(3 x 0.34), 1) = 1 client a round
        ({"quantization_range": 2**31}, 1.0, "privacy.secagg.quantization_range 2147483648 x 3 clients"),
        ({"quantization_range": 4}, 1.0, "privacy.secagg.quantization_range 4 is below the largest client weight 6"),
    ],
)
def test_a_params_value_secagg_cannot_run_with_ends_the_train_stage_in_one_line(
    ws, capsys, secagg, fraction_train, names_key
):
    """A params.yaml value (the plan stage accepts it) that SecAgg+ cannot run with: the train stage ends with exit 2
    and one line naming it (pipeline/common/cli.py), not a traceback."""
    from pipeline.common.cli import run as run_cli
    from pipeline.train import main

    path = _write_plan("sa-bad", "fedavg", {**SECURE, "secagg": secagg}, fraction_train=fraction_train)
    status = run_cli(main, ["--experiment", "sa-bad", "--plans", str(Path(path).parent), "--no-mlflow"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and names_key in err[0] and "sa-bad" in err[0]


def _drop(monkeypatch, stage: str, client: str = "Committee", rnd: int = 1) -> None:
    """``client`` dies in round ``rnd``: at the setup or share-keys stage (before its key shares went out: Flower
    1.41 alone loses the round, pipeline.privacy.secure_aggregation._Workflow forgets the client), while training
    (after the key exchange: its pairwise masks are in the others' vectors) or at the unmask stage (after its
    masked vector is in the sum)."""
    import importlib

    from pipeline.training import client_training as local_training

    mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")  # the package exports the
    # function under the module's name

    if stage == "training":
        real = local_training.train_local

        def train_local(model, plan, examples, *, client: str, rnd: int, **kw):
            if (client, rnd) == (target, at):
                raise RuntimeError("simulated crash while training")
            return real(model, plan, examples, client=client, rnd=rnd, **kw)

        target, at = client, rnd
        monkeypatch.setattr(local_training, "train_local", train_local)
    else:  # one of the mod's protocol stages: setup, share_keys, unmask
        name = "_" + stage
        real_stage = getattr(mod, name)
        node = 1000 + list(N_TRAIN).index(client)  # the in-process Grid's node ids, in partition order
        calls = {"n": 0}

        def crash(state, configs, *args):
            if state.nid == node:
                calls["n"] += 1
                if calls["n"] == rnd:
                    raise RuntimeError(f"simulated crash at {stage}")
            return real_stage(state, configs, *args)

        monkeypatch.setattr(mod, name, crash)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", ["setup", "share_keys", "training", "unmask"])
def test_a_client_dropped_in_the_middle_of_a_round_is_survived(ws, monkeypatch, stage):
    from pipeline.train import run_experiment

    uploads, globals_ = _spy_uploads(monkeypatch), _spy_globals(monkeypatch)
    _drop(monkeypatch, stage)
    name = f"sa-drop-{stage}"
    metrics = run_experiment(_write_plan(name, "fedavg", SECURE), track=False)
    survivors = list(N_TRAIN) if stage == "unmask" else ["Academic", "Product"]
    # round 1: the sum of the clients whose masked vector arrived, unmasked with the others' shares (2 of 3)
    _check_rounds_against_uploads(uploads, globals_, (1, 2), lambda rnd: survivors if rnd == 1 else list(N_TRAIN))
    rows = {(r["round"], r["client"]): r for r in json.loads(Path(f"models/{name}/rounds.json").read_text())}
    dropped = rows[(1, "Committee")]
    if stage != "unmask":
        protocol_stage = "collect_masked_vectors" if stage == "training" else stage
        assert dropped["failed"] == 1 and "weight_share" not in dropped
        assert dropped["error"].startswith(f"SecAgg+ {protocol_stage}: RuntimeError in client Committee's train")
        assert rows[(1, "Academic")]["weight_share"] == pytest.approx(4 / 9)
        assert metrics["secure_aggregation"]["dropped"] == {"Committee": 1}
    else:  # in the sum: only its own shares are missing, and the others' rebuild its mask
        assert dropped["failed"] == 0 and dropped["secagg_error"].startswith("SecAgg+ unmask: RuntimeError")
        assert metrics["secure_aggregation"]["dropped"] == {}
    assert rows[(2, "Committee")]["failed"] == 0  # back in the next round
    assert metrics["secure_aggregation"]["rounds_aggregated"] == 2


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_below_the_reconstruction_threshold_the_round_is_not_aggregated(ws, monkeypatch):
    from pipeline.experiments.plans import read_plan
    from pipeline.train import run_experiment
    from pipeline.training.shared_model import initial_adapter_state

    globals_ = _spy_globals(monkeypatch)
    _drop(monkeypatch, "training")
    name = "sa-threshold"
    path = _write_plan(name, "fedavg", {**SECURE, "secagg": {"reconstruction_threshold": 3}})  # 3 of 3 shares
    metrics = run_experiment(path, track=False)
    initial = initial_adapter_state(read_plan(path))
    assert max_diff(globals_[1], {k: v.numpy() for k, v in initial.items()}) == 0.0  # nothing unmasked
    assert max_diff(globals_[2], globals_[1]) > 0  # round 2, all three back, is aggregated
    rows = {(r["round"], r["client"]): r for r in json.loads(Path(f"models/{name}/rounds.json").read_text())}
    assert all(rows[(1, c)]["failed"] == 1 for c in N_TRAIN)
    assert rows[(1, "Academic")]["error"] == (
        "SecAgg+ could not unmask the sum: 2 of 3 sampled clients uploaded, reconstruction threshold 3 of 3 shares"
    )
    assert rows[(1, "Committee")]["error"].startswith("SecAgg+ collect_masked_vectors")
    assert metrics["secure_aggregation"]["dropped"] == {c: 1 for c in N_TRAIN}
    assert metrics["secure_aggregation"]["rounds_aggregated"] == 1


@pytest.mark.slow
def test_a_killed_secure_run_resumes_to_the_uninterrupted_result(ws, monkeypatch):
    # The restarted clients hold no SecAgg+ state (their contexts died with the run): round 2's protocol starts
    # afresh, and the stochastic rounding draws from the generator each client's training seeded.
    from pipeline.train import run_experiment
    from tests.faults import killed_after_checkpoint
    from tests.test_federated import _final_adapters

    run_experiment(_write_plan("sa-whole", "fedavg", SECURE), track=False)
    path = _write_plan("sa-resumed", "fedavg", SECURE)
    with killed_after_checkpoint(monkeypatch, rnd=1):
        run_experiment(path, track=False)
    run_experiment(path, track=False)
    a, b = _final_adapters("sa-resumed"), _final_adapters("sa-whole")
    assert a.keys() == b.keys() == set(N_TRAIN)
    for client in a:
        for k in a[client]:
            np.testing.assert_array_equal(a[client][k].numpy(), b[client][k].numpy())


# ------------------------------------------------------------------------------------------ malformed replies
def _configs(content):
    return content.config_records["secaggplus_configs"]


def _replace(key: str, value):
    """A reply whose protocol value ``key`` is ``value(the value sent)``."""
    return lambda c: _configs(c).__setitem__(key, value(_configs(c)[key]))


def _as_float(masked: list[bytes]) -> list[bytes]:
    from flwr.common import bytes_to_ndarray, ndarray_to_bytes

    return [ndarray_to_bytes(bytes_to_ndarray(b).astype(np.float64)) for b in masked]


def _huge_header(masked: list[bytes]) -> list[bytes]:
    """A valid .npy header declaring 2**40 int64 (8 TiB), and no data: np.load allocated them (MemoryError)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i8", "fortran_order": False, "shape": (2**40,)})
    return [buf.getvalue()] * len(masked)


def _as_npz(masked: list[bytes]) -> list[bytes]:
    """Each array as a .npz archive: np.load gave an NpzFile, whose missing shape raised AttributeError."""
    from flwr.common import bytes_to_ndarray

    out = []
    for b in masked:
        buf = io.BytesIO()
        np.savez(buf, bytes_to_ndarray(b))
        out.append(buf.getvalue())
    return out


def _a_share_twice(content) -> None:
    """An unmask reply that repeats its first node's share: Shamir's combine of that node raised 'Duplicate share'."""
    cfg = _configs(content)
    cfg["nids"], cfg["shares"] = [*cfg["nids"], cfg["nids"][0]], [*cfg["shares"], cfg["shares"][0]]


UPLOADS = {1000: 0.5, 1001: 3.0, 1002: 1.25}  # node -> its update's first coordinate (then + 0.25, + 0.5)
WEIGHTS = {1000: 1, 1001: 2, 1002: 3}
CLIENTS = {1000: "Academic", 1001: "Committee", 1002: "Product"}


def _train_messages(nodes) -> list:
    """A train message of a 3-float global of zeros to each of ``nodes``."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

    from pipeline.federation.protocol import ARRAYS_KEY, CONFIG_KEY

    global_ = ArrayRecord({"w": Array(np.zeros(3, dtype=np.float32))})
    return [
        Message(RecordDict({ARRAYS_KEY: global_, CONFIG_KEY: ConfigRecord({})}), dst_node_id=n, message_type="train")
        for n in nodes
    ]


def _round_with_committee(stage: str, corrupt, caplog):
    """One SecAgg+ round of the real workflow and mod over the in-process grid, Committee's reply of ``stage``
    changed by ``corrupt`` (a non-genuine client: Flower's mod never sends it so), through the server's
    _train_secure: (what it released, the clients' rows, the federation log, the SecAgg+ scale)."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from pipeline.federation.engines import InProcessGrid, _set_server_identity
    from pipeline.federation.protocol import ARRAYS_KEY, METRICS_KEY
    from pipeline.federation.server_app import _Round, _train_secure
    from pipeline.privacy.secure_aggregation import SecureAggregator, legacy_fit, secure_aggregation_mod
    from tests.test_server_loop import _secagg_plan, _secure_metrics, _secure_rows, logged

    def local(msg, context):
        node = context.node_id
        arrays = ArrayRecord({"w": Array(np.float32(UPLOADS[node]) + np.arange(3, dtype=np.float32) / 4)})
        metrics = {k: v for k, v in _secure_metrics(WEIGHTS[node]).items() if k != "secagg-clipped"}
        return Message(RecordDict({ARRAYS_KEY: arrays, METRICS_KEY: MetricRecord(metrics)}), reply_to=msg)

    app = ClientApp(mods=[secure_aggregation_mod])
    app.train()(lambda msg, context: legacy_fit(msg, context, local))
    grid = InProcessGrid(app, [{"client-name": c} for c in CLIENTS.values()])
    _set_server_identity(grid.run.run_id)
    send = grid.send_and_receive

    def send_and_receive(messages, *, timeout=None):
        messages = list(messages)
        replies = list(send(messages, timeout=timeout))
        if str(_configs(messages[0].content)["stage"]) == stage:
            corrupt(next(r for r in replies if r.metadata.src_node_id == 1001).content)
        return replies

    grid.send_and_receive = send_and_receive
    msgs = _train_messages(CLIENTS)
    rows = _secure_rows(CLIENTS.values())
    secure = SecureAggregator(SecAggConfig(), max_weight=3, timeout=5.0)
    np.random.seed(0)  # Flower's stochastic rounding draws from numpy's global generator
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        released = _train_secure(secure, _Round(grid, None, 3, rows, CLIENTS, 5.0), msgs, _secagg_plan())
    return released, rows, logged(caplog), secure.scale


@pytest.mark.parametrize(
    "stage, corrupt, summed, problem",
    [  # summed: Committee's masked vector is in the sum (whole), else it is lost in ``stage`` as a dropped client
        ("setup", lambda c: _configs(c).pop("pk1"), False, "pk1"),
        ("setup", _replace("pk1", lambda _: 5), False, "not bytes"),
        ("share_keys", _replace("ctxts", lambda v: list(v)[:-1]), False, "shorter"),
        ("share_keys", _replace("ctxts", lambda v: [1] * len(v)), False, "not bytes"),
        ("collect_masked_vectors", lambda c: _configs(c).pop("masked_params"), False, "masked_params"),
        ("collect_masked_vectors", _replace("masked_params", lambda v: list(v)[:1]), False, "shapes"),
        (
            "collect_masked_vectors",
            _replace("masked_params", lambda v: [b""] * len(v)),
            False,
            "EOF: reading magic string",
        ),
        ("collect_masked_vectors", _replace("masked_params", _as_float), False, "float64"),
        (
            "collect_masked_vectors",
            _replace("masked_params", _huge_header),
            False,
            "0 data bytes for int64[1099511627776]",
        ),
        ("collect_masked_vectors", _replace("masked_params", lambda v: [b[:-8] for b in v]), False, "ValueError"),
        ("collect_masked_vectors", _replace("masked_params", _as_npz), False, "magic string"),
        (
            "collect_masked_vectors",
            _replace("masked_params", lambda v: [b[:6] + b"\4\0" + b[8:] for b in v]),
            False,
            "version",
        ),
        # the FitRes parts beside the masked vector: Flower converts them, the server never reads them (the
        # unmasked sum replaces FitRes.parameters; the weight is in the vector; the metrics are fitres.metrics)
        ("collect_masked_vectors", lambda c: c.metric_records.pop("fitres.num_examples"), True, None),
        ("collect_masked_vectors", lambda c: c.array_records.pop("fitres.parameters"), True, None),
        ("collect_masked_vectors", lambda c: c.config_records.pop("fitres.status"), True, None),
        ("unmask", lambda c: _configs(c).pop("nids"), True, "nids"),
        ("unmask", _replace("nids", lambda v: [77] * len(v)), True, "[77"),
        ("unmask", _replace("shares", lambda v: list(v)[:-1]), True, "shorter"),
        ("unmask", _replace("shares", lambda v: [1] * len(v)), True, "not bytes"),
        ("unmask", _a_share_twice, True, "two shares of one node"),
    ],
)
def test_a_malformed_protocol_reply_is_that_clients_loss_not_the_end_of_the_run(
    caplog, stage, corrupt, summed, problem
):
    """Before, Flower's workflow raised on each of these (KeyError, IndexError, EOFError, ValueError from a strict zip,
    TypeError building the next stage's ConfigRecord or reducing a float vector modulo an integer) and ended the
    server's run. Now the round goes on without what cannot be read: a reply before the masked vector, or the vector
    itself, makes Committee a client dropped in that stage (one line naming the stage and the problem) and the
    others' mean is released; an unmask reply is set aside, the others' shares unmask the sum of all three. The
    released mean against numpy's weighted mean of the uploads, within the quantisation bound."""
    from pipeline.privacy.secure_aggregation import aggregation_error_bound

    released, rows, log, scale = _round_with_committee(stage, corrupt, caplog)
    in_sum = list(CLIENTS) if summed else [1000, 1002]
    uploads = [np.float64(UPLOADS[n]) + np.arange(3) / 4 for n in in_sum]
    expected = np.average(uploads, axis=0, weights=[WEIGHTS[n] for n in in_sum])
    bound = aggregation_error_bound([WEIGHTS[n] for n in in_sum], scale, SecAggConfig(), 3.5)
    assert np.abs(released["w"].numpy() - expected).max() <= bound
    assert rows["Academic"]["failed"] == rows["Product"]["failed"] == 0
    committee = rows["Committee"]
    if not summed:
        assert committee["failed"] == 1 and "weight" not in committee
        names(committee["error"], f"SecAgg+ {stage}: ", problem)
        assert len(log) == 2  # Committee left out, and the sum of 2 of the 3
        logs(log, "round 3", "Committee", stage, problem)
    else:
        assert committee["failed"] == 0 and committee["weight"] == 2 and "error" not in committee
        if problem is None:
            assert "secagg_error" not in committee and log == []
        else:  # its masked vector is in the sum: the row says why its shares were not used
            names(committee["secagg_error"], "SecAgg+ unmask: ", problem)


def test_a_share_of_the_right_form_but_wrong_halts_the_round_not_the_run(caplog):
    """Committee's unmask reply holds a bytes share for each node it should, each 10 bytes instead of 4 + 16 k:
    Shamir's combine raises (ValueError) inside Flower's unmask step, which cannot tell whose share was wrong, and
    ended the run. Now the round halts as when too few shares came: nothing released (the global stays), every
    sampled client failed with one line naming the SecAgg+ unmask failure."""
    released, rows, log, _ = _round_with_committee("unmask", _replace("shares", lambda v: [b"x" * 10] * len(v)), caplog)
    assert released is None
    for client in CLIENTS.values():
        assert rows[client]["failed"] == 1
        names(rows[client]["error"], "SecAgg+ could not unmask the sum: ValueError")
        logs(log, "round 3", client, "SecAgg+ could not unmask the sum: ValueError")
    assert len(log) == 3


def test_a_server_side_fault_in_the_unmask_stage_surfaces_not_as_a_halted_round(caplog, monkeypatch):
    """The server's own link failing while it asks for the unmask shares (a ConnectionError from the grid) is no
    client's share or key: it was turned into a halted round with every sampled client failed. Now it propagates
    (the run stops, as for any server fault; a restart resumes from the last finished round)."""
    from pipeline.privacy import secure_aggregation as sa

    real = sa.replies_by_node

    def flaky(grid, messages, timeout):
        if str(_configs(messages[0].content)["stage"]) == "unmask":
            raise ConnectionError("SuperLink unreachable")
        return real(grid, messages, timeout)

    monkeypatch.setattr(sa, "replies_by_node", flaky)
    with pytest.raises(ConnectionError, match="SuperLink unreachable"):
        _round_with_committee("setup", lambda c: None, caplog)


@pytest.mark.parametrize("first", ["setup", "share_keys"])
def test_a_client_lost_before_its_shares_and_one_lost_at_the_masked_vector_leave_the_survivors_mean(caplog, first):
    """Five clients, genuine failures only: node 1000's mod raises in ``first`` (before its key shares went out),
    node 1001's training raises (lost at the masked-vector stage). Flower removes 1001's pairwise masks with every
    node in its neighbour set; 1000 was still in it, though no vector was masked with 1000: lost at share-keys, the
    server subtracted a mask nobody added and released a wrong mean silently; lost at setup (no public key), the
    round halted with KeyError. Now the released mean is numpy's mean of the three survivors' uploads, within the
    quantisation bound."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from pipeline.federation.engines import InProcessGrid, _set_server_identity
    from pipeline.federation.protocol import ARRAYS_KEY, METRICS_KEY
    from pipeline.federation.server_app import _Round, _train_secure
    from pipeline.privacy.secure_aggregation import (
        SecureAggregator,
        aggregation_error_bound,
        legacy_fit,
        secure_aggregation_mod,
    )
    from tests.test_server_loop import _secagg_plan, _secure_metrics, _secure_rows

    nodes = [1000, 1001, 1002, 1003, 1004]
    names_ = {n: f"C{i}" for i, n in enumerate(nodes)}
    upload = {n: np.float32(0.5 * i) + np.arange(3, dtype=np.float32) / 4 for i, n in enumerate(nodes)}

    def local(msg, context):
        if context.node_id == 1001:
            raise RuntimeError("out of memory while training")
        arrays = ArrayRecord({"w": Array(upload[context.node_id])})
        metrics = {k: v for k, v in _secure_metrics(1).items() if k != "secagg-clipped"}
        return Message(RecordDict({ARRAYS_KEY: arrays, METRICS_KEY: MetricRecord(metrics)}), reply_to=msg)

    def failing_mod(msg, context, call_next):
        cfg = msg.content.config_records.get("secaggplus_configs")
        if context.node_id == 1000 and cfg is not None and str(cfg["stage"]) == first:
            raise RuntimeError("connection lost")
        return secure_aggregation_mod(msg, context, call_next)

    app = ClientApp(mods=[failing_mod])
    app.train()(lambda msg, context: legacy_fit(msg, context, local))
    grid = InProcessGrid(app, [{"client-name": names_[n]} for n in nodes])
    _set_server_identity(grid.run.run_id)
    msgs = _train_messages(nodes)
    rows = _secure_rows(names_.values())
    secure = SecureAggregator(SecAggConfig(), max_weight=1, timeout=5.0)
    np.random.seed(0)
    with caplog.at_level(logging.INFO, logger="fedmeet.federated"):
        released = _train_secure(secure, _Round(grid, None, 3, rows, names_, 5.0), msgs, _secagg_plan())
    survivors = [1002, 1003, 1004]
    expected = np.mean([upload[n].astype(np.float64) for n in survivors], axis=0)
    assert released is not None, rows
    bound = aggregation_error_bound([1] * len(survivors), secure.scale, SecAggConfig(), 2.5)
    assert np.abs(released["w"].numpy() - expected).max() <= bound
    assert [rows[names_[n]]["failed"] for n in nodes] == [1, 1, 0, 0, 0]
    names(rows["C0"]["error"], f"SecAgg+ {first}: ", "RuntimeError")
    names(rows["C1"]["error"], "SecAgg+ collect_masked_vectors: ", "RuntimeError")


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "method,why",
    [
        ("fedopt", "server (fedopt) does more than average"),
        ("fednova", "server (fednova) does more than average"),
        ("single", "trains without a server"),
        ("centralized", "trains without a server"),
    ],
)
def test_refused_for_servers_that_do_more_than_average_and_for_local_methods(method, why):
    from pipeline.planning import parse_entry, resolve_plan

    params = _params(SECURE)
    with pytest.raises(ConfigError) as exc:
        resolve_plan(parse_entry("x", {"method": method, "partition": "domain/seed0"}, params), params)
    message = str(exc.value)
    assert "\n" not in message and message.startswith("params.yaml experiments.x: privacy.secure_aggregation: ")
    assert why in message


def test_accepted_for_servers_that_only_average_and_refused_with_a_lossy_transfer():
    from pipeline.planning import parse_entry, resolve_plan

    params = _params(SECURE)
    for method in ("fedavg", "fedkd", "fedselectkd", "fedprox", "hardkd", "post_addition", "pre_addition"):
        partition = "extreme/seed0" if method == "post_addition" else "domain/seed0"  # its new client: SAMSum
        entry = parse_entry("x", {"method": method, "partition": partition}, params)
        assert resolve_plan(entry, params)["privacy"]["secure_aggregation"] is True
    params = _params(SECURE, transfer_dtype="int8")
    with pytest.raises(
        ConfigError,
        match=r"^params.yaml experiments.x: privacy.secure_aggregation: "
        r"train.transfer_dtype is int8: .* must be fp32$",
    ):
        resolve_plan(parse_entry("x", {"method": "fedavg", "partition": "domain/seed0"}, params), params)


def test_a_hand_written_plan_is_refused_by_the_server_and_plain_messages_by_the_client(ws, caplog):
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    from pipeline.experiments.plans import read_plan
    from pipeline.federation.client_app import client_app
    from pipeline.federation.engines import _set_server_identity
    from pipeline.train import run_experiment
    from pipeline.training.shared_model import initial_adapter_state

    path = Path(_write_plan("sa-hand", "fedavg", SECURE))
    plan = json.loads(path.read_text())
    path.write_text(json.dumps(plan | {"method": "fednova"}))
    with pytest.raises(ValueError, match="privacy.secure_aggregation: method 'fednova'"):
        run_experiment(str(path), track=False)

    path.write_text(json.dumps(plan))
    _set_server_identity(1)
    msg = Message(
        RecordDict(
            {
                "arrays": ArrayRecord.from_torch_state_dict(initial_adapter_state(read_plan(path))),
                "config": ConfigRecord({"server-round": 1, "plan": str(path)}),
            }
        ),
        dst_node_id=1000,
        message_type="train",
    )
    msg.metadata.__dict__["_message_id"] = "plain"
    context = Context(
        run_id=1, node_id=1000, node_config={"client-name": "Committee"}, state=RecordDict(), run_config={}
    )
    with caplog.at_level(logging.ERROR, logger="fedmeet.federated"):
        reply = client_app(msg, context)  # refused: an error reply (its class only), no adapter
    assert reply.has_error() and reply.error.reason.startswith("ValueError in client Committee's train of round 1")
    assert "uploads its adapter only through SecAgg+" in caplog.text  # the reason, in the client's log


@pytest.mark.parametrize("weight, refused", [(10, False), (11, True)])
def test_a_train_reply_heavier_than_the_servers_max_weight_is_the_clients_failure_not_a_clipped_upload(weight, refused):
    """SecAgg+ scales each upload by weight / max_weight before quantising it (max_weight: from the train sizes the
    clients reported at admission); above 1, Flower only logs a warning and its quantiser clips the scaled values, so
    the unmasked mean would be wrong with no error. A client whose train reply weighs more (its data grew since
    admission) fails the round instead; at max_weight it uploads as before."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.common import FitIns, ndarrays_to_parameters
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE
    from flwr.compat.common import recorddict_compat as compat

    from pipeline.federation.engines import _set_server_identity
    from pipeline.federation.protocol import ARRAYS_KEY, METRICS_KEY
    from pipeline.federation.strategies.registry import NUM_EXAMPLES_KEY
    from pipeline.privacy.secure_aggregation import ARRAY_KEYS, legacy_fit

    _set_server_identity(1)
    upload = np.full((2, 3), 0.5, dtype=np.float32)
    content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters([upload]), {ARRAY_KEYS: '["w"]'}), True)
    content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord({})
    context = Context(run_id=1, node_id=1000, node_config={}, state=RecordDict(), run_config={})
    context.state.config_records[RECORD_KEY_STATE] = ConfigRecord({"max_weight": 10.0, "clipping_range": 8.0})

    def train(msg, _context):
        reply = RecordDict({ARRAYS_KEY: ArrayRecord({"w": msg.content[ARRAYS_KEY]["w"]})})
        reply[METRICS_KEY] = MetricRecord({NUM_EXAMPLES_KEY: weight})
        return Message(reply, reply_to=msg)

    msg = Message(content, dst_node_id=1000, message_type="train")
    msg.metadata.__dict__["_message_id"] = "masked-vector"
    if refused:
        with pytest.raises(RuntimeError, match=r"^train reply: weight 11 is above SecAgg\+'s max_weight 10, sized by"):
            legacy_fit(msg, context, train)
    else:
        fitres = compat.recorddict_to_fitres(legacy_fit(msg, context, train).content, keep_input=True)
        assert fitres.num_examples == 10 and fitres.metrics["secagg-clipped"] == 0


# ------------------------------------------------------------------------------------------ params and plans
def test_secagg_group_validation():
    cfg = from_dict(
        PrivacyConfig,
        {"secure_aggregation": True, "secagg": {"num_shares": 5, "reconstruction_threshold": 3}},
        "privacy",
    )
    assert cfg.secure_aggregation and not cfg.enabled and cfg.secagg.num_shares == 5
    bad = [
        ({"num_shares": 2}, "privacy.secagg.num_shares as a count must be > 2"),
        ({"num_shares": 1.5}, "privacy.secagg.num_shares=1.5 is out of range; allowed: > 0 and <= 1"),
        (
            {"reconstruction_threshold": 1.2},
            "privacy.secagg.reconstruction_threshold=1.2 is out of range; allowed: > 0 and <= 1",
        ),
        ({"num_shares": 4, "reconstruction_threshold": 4}, "must be >= 2 and < num_shares"),
        ({"clipping_range": 0.0}, "privacy.secagg.clipping_range=0.0 is out of range; allowed: > 0"),
        (
            {"quantization_range": 2**32},
            "privacy.secagg.quantization_range=4294967296 is out of range; allowed: > 1 and < 4294967296",
        ),
        ({"num_shares": True}, "privacy.secagg.num_shares: expected an integer or a number"),
        ({"quantisation_range": 4096}, "privacy.secagg: unknown key(s) ['quantisation_range']"),
    ]
    for secagg, message in bad:
        with pytest.raises(ConfigError) as exc:
            from_dict(PrivacyConfig, {"secure_aggregation": True, "secagg": secagg}, "privacy")
        assert message in str(exc.value) and "\n" not in str(exc.value), (secagg, str(exc.value))
    with pytest.raises(ConfigError, match="privacy.secure_aggregation: expected true or false"):
        from_dict(PrivacyConfig, {"secure_aggregation": "yes"}, "privacy")


def test_secure_aggregation_enters_plans_only_when_on(ws):
    from pipeline.experiments.plans import read_plan, record_hash
    from pipeline.planning import parse_entry, resolve_plan

    entry = parse_entry("x", {"method": "fedselectkd", "partition": "domain/seed0", "tau": 5.0}, _params(None))
    other_settings = {"clipping_range": 2.0, "num_shares": 4, "reconstruction_threshold": 3}
    plain = resolve_plan(entry, _params(None))
    assert resolve_plan(entry, _params({"secure_aggregation": False, "secagg": other_settings})) == plain
    example = {"mode": "example", "target_epsilon": 3.0}
    dp = resolve_plan(entry, _params(example))
    assert resolve_plan(entry, _params(example | {"secagg": other_settings})) == dp  # off: DP plans unchanged
    on = resolve_plan(entry, _params(SECURE))
    assert on == plain | {
        "privacy": {
            "mode": "none",
            "secure_aggregation": True,
            "secagg": {
                "num_shares": 1.0,
                "reconstruction_threshold": 0.67,
                "clipping_range": 8.0,
                "quantization_range": 2**22,
            },
        }
    }
    both = resolve_plan(entry, _params(example | SECURE))
    assert both["privacy"] == dp["privacy"] | on["privacy"] | {"mode": "example"}
    # what a run hashes (Plan.to_json_dict) is what the plan file holds, with and without secure aggregation
    for name, resolved in (("h-dp", dp), ("h-on", on), ("h-both", both)):
        p = Path(f"models/plans/{name}.json")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(resolved))
        assert read_plan(p).to_json_dict()["privacy"] == resolved["privacy"]
    assert read_plan("models/plans/h-on.json").hash != read_plan("models/plans/h-dp.json").hash
    assert record_hash(read_plan("models/plans/h-dp.json").to_json_dict()) == read_plan("models/plans/h-dp.json").hash


def test_params_yaml_secagg_group_is_off_and_valid():
    import yaml

    params = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    cfg = from_dict(PrivacyConfig, params["privacy"], "params.yaml privacy")
    assert cfg.secure_aggregation is False and cfg.secagg == SecAggConfig()


# ------------------------------------------------------------------------------------------ with client-level DP
def _client_dp(**kw) -> dict:
    """privacy.mode client, client-side fixed clipping, by default at C = 1e-3 (far below the tiny model's round
    updates, whose norms are 0.1-0.3: every contribution to the mean is then exactly C long)."""
    return {"mode": "client", "noise_multiplier": 0.0, "clipping_norm": 1e-3, "clipping_side": "client", **kw}


def _clipped_mean(
    seen, rnd: int, c: float, weights: dict[str, int] | None = None
) -> tuple[dict[str, np.ndarray], list[float]]:
    """The mean (uniform, or with ``weights``) of the clients' received global plus their update scaled to L2
    norm <= c (float64), and each update's norm before clipping: the expected aggregate, computed independently of
    Flower's clipping mod from what :func:`_spy_uploads` saw."""
    contributions, norms, w = [], [], []
    for (r, client), (trained, _weight, _masked, received) in sorted(seen.items()):
        if r != rnd:
            continue
        update = {k: trained[k].astype(np.float64) - received[k].astype(np.float64) for k in received}
        norm = math.sqrt(sum(float((u**2).sum()) for u in update.values()))
        scale = min(1.0, c / norm)
        clipped = {k: u * scale for k, u in update.items()}
        assert math.sqrt(sum(float((u**2).sum()) for u in clipped.values())) <= c * (1 + 1e-9)
        contributions.append({k: received[k].astype(np.float64) + clipped[k] for k in received})
        norms.append(norm)
        w.append(1 if weights is None else weights[client])
    return {k: sum(wi * s[k] for wi, s in zip(w, contributions)) / sum(w) for k in contributions[0]}, norms


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_client_side_clipping_under_secagg_gives_the_client_dp_aggregate_within_the_bound(ws, monkeypatch):
    from pipeline.federation.protocol import TRAIN_METRICS
    from pipeline.privacy.secure_aggregation import aggregation_error_bound
    from pipeline.train import run_experiment

    seen, globals_ = _spy_uploads(monkeypatch), _spy_globals(monkeypatch)
    replies = _spy_masked_vector_replies(monkeypatch)
    c = 0.18  # between the tiny model's round-1 update norms (0.13, 0.23, 0.24): one left as it is, two clipped
    secure = run_experiment(_write_plan("sa-cdp", "fedavg", {**SECURE, **_client_dp(clipping_norm=c)}), track=False)
    secure_seen, secure_r1 = dict(seen), globals_[1]
    expected, norms = _clipped_mean(secure_seen, 1, c)
    assert min(norms) < c < max(norms)  # the clipping matters, and not for every client

    # uniform weights (q_i = Q for each of the 3 clients) and the bound of a mean of the clipped uploads
    cfg = SecAggConfig()
    m = max(float(np.abs(v).max()) for *_, received in secure_seen.values() for v in received.values()) + c
    bound = aggregation_error_bound([1, 1, 1], cfg.quantization_range, cfg, m)
    slack = 4 * 2.0**-24 * m  # float32 of the client's W + clip(W_i - W) against the float64 expectation
    assert max_diff(secure_r1, expected) <= bound + slack
    # (the clients' FedAvg weights 4, 6, 5 would give a mean far outside the bound: the mean is the uniform one)
    assert max_diff(_clipped_mean(secure_seen, 1, c, N_TRAIN)[0], expected) > 10 * bound

    # the same plan without SecAgg+: its round-1 uploads are the same, its aggregate is the same clipped mean
    seen.clear()
    plain = run_experiment(_write_plan("cdp-clear", "fedavg", _client_dp(clipping_norm=c)), track=False)
    for key, (trained, *_) in seen.items():
        if key[0] == 1:
            assert max_diff(trained, secure_seen[key][0]) == 0.0
    assert max_diff(globals_[1], expected) <= slack
    assert max_diff(secure_r1, globals_[1]) <= bound + 2 * slack

    # what the server recorded: the same accounting and clipped fraction, no norm, and no clipped bit in the clear
    for key in (
        "rounds_released",
        "updates_aggregated",
        "clipped_fraction",
        "epsilon",
        "noise_multiplier",
        "clipping_norm",
        "sample_rate",
        "delta",
    ):
        assert secure["privacy"][key] == plain["privacy"][key], key
    assert secure["privacy"]["clipping_side"] == "client"
    assert secure["clients"]["Academic"]["privacy"] == {"updates_aggregated": 2}  # its own share is not known
    rows = [r for r in json.loads(Path("models/sa-cdp/rounds.json").read_text()) if r["round"] == 1]
    clipped_share = sum(n > c for n in norms) / len(norms)  # 2 of 3, from the bits summed under the masks
    assert all(
        r["update_clipped"] == pytest.approx(clipped_share)
        and r["update_norm"] is None
        and r["weight_share"] == pytest.approx(1 / 3)
        for r in rows
    )
    assert len(replies) == 2 * len(N_TRAIN)
    for r, sent in replies:
        assert set(sent) == set(TRAIN_METRICS) | {"secagg-clipped"}
        masked = r.content.config_records["secaggplus_configs"]["masked_params"]
        assert len(masked) == 1 + len(secure_r1) + 1  # the weight, the adapter's tensors, the clipped bit


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_noise_on_the_unmasked_mean_has_the_client_dp_std_and_seed(ws, monkeypatch):
    from scipy import stats

    from pipeline.privacy.secure_aggregation import upload_error
    from pipeline.train import run_experiment

    globals_ = _spy_globals(monkeypatch)
    z, c, m = 2.0, 1e-3, len(N_TRAIN)
    run_experiment(_write_plan("sa-cdp-quiet", "fedavg", {**SECURE, **_client_dp()}), track=False)
    quiet = globals_[1]
    noisy = run_experiment(
        _write_plan("sa-cdp-noisy", "fedavg", {**SECURE, **_client_dp(noise_multiplier=z)}), track=False
    )
    noise = np.concatenate([(globals_[1][k] - quiet[k]).astype(np.float64).ravel() for k in quiet])
    n = noise.size
    assert n > 1000
    # Flower's compute_stdv z C' / (clients sampled per round), C' = C + sqrt(d)(2c/Q + 10uc): what one client's
    # quantised upload can move the sum by (test_client_level_noise_under_secagg_covers_what_a_quantised_upload_adds)
    std = z * (c + math.sqrt(n) * upload_error(SecAggConfig())) / m
    assert abs(noise.std() - std) < 5 * std / math.sqrt(2 * n)  # 5 standard errors of the std
    assert abs(noise.mean()) < 5 * std / math.sqrt(n)
    assert stats.kstest(noise / std, "norm").pvalue > 1e-3
    # seeded as in the clear: the run without SecAgg+ draws the same noise, times C' / C (within the quantisation bound)
    secure_noisy, scale = globals_[1], std / (z * c / m)
    clear = run_experiment(_write_plan("cdp-clear-noisy", "fedavg", _client_dp(noise_multiplier=z)), track=False)
    scaled = {k: quiet[k] + scale * (globals_[1][k] - quiet[k]) for k in quiet}
    assert max_diff(secure_noisy, scaled) < 0.01 * std  # two independent draws: ~4 std apart somewhere
    assert noisy["privacy"]["epsilon"] == clear["privacy"]["epsilon"] and 0 < noisy["privacy"]["epsilon"] < math.inf


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_adaptive_clipping_under_secagg_moves_c_as_in_the_clear(ws):
    # C's update needs only the count of clipped updates: their bits are summed under the masks, then the same
    # seeded count noise as in the clear; round 2's C is the clear run's
    from pipeline.train import run_experiment

    privacy = _client_dp(noise_multiplier=0.5, clipping="adaptive", clipped_count_stddev=1.0)
    secure = run_experiment(_write_plan("sa-cdp-adaptive", "fedavg", {**SECURE, **privacy}), track=False)
    clear = run_experiment(_write_plan("cdp-clear-adaptive", "fedavg", privacy), track=False)
    c2 = {
        name: {
            r["clipping_norm"] for r in json.loads(Path(f"models/{name}/rounds.json").read_text()) if r["round"] == 2
        }
        for name in ("sa-cdp-adaptive", "cdp-clear-adaptive")
    }
    assert len(c2["sa-cdp-adaptive"]) == 1 and c2["sa-cdp-adaptive"] == c2["cdp-clear-adaptive"]
    assert c2["sa-cdp-adaptive"] != {1e-3}  # it moved
    assert secure["privacy"]["epsilon"] == clear["privacy"]["epsilon"]


def test_server_side_clipping_under_secagg_is_refused_at_plan_time_and_by_the_server(ws):
    from pipeline.planning import parse_entry, resolve_plan
    from pipeline.train import run_experiment

    params = _params({**SECURE, **_client_dp(clipping_side="server")})
    with pytest.raises(ConfigError) as exc:
        resolve_plan(parse_entry("x", {"method": "fedavg", "partition": "domain/seed0"}, params), params)
    names(exc.value, "params.yaml", "experiments.x", "privacy.secure_aggregation", "clipping_side")
    path = Path(_write_plan("sa-cdp-hand", "fedavg", {**SECURE, **_client_dp()}))
    plan = json.loads(path.read_text())
    plan["privacy"]["clipping_side"] = "server"
    path.write_text(json.dumps(plan))
    with pytest.raises(
        ValueError,
        match=r"sa-cdp-hand.json: privacy.secure_aggregation: privacy.mode client needs "
        r"clipping_side client under SecAgg\+: [^\n]*$",
    ):
        run_experiment(str(path), track=False)


def test_the_privacy_docs_secagg_numbers_are_the_benchmarks_json():
    """docs/privacy.md quotes reports/bench/secure_aggregation.json: the bound, the measured error and its share of
    the bound, the clients, and the int64 upload per client."""
    root = Path(__file__).resolve().parents[1]
    text = " ".join((root / "docs/privacy.md").read_text(encoding="utf-8").split())
    bench = json.loads((root / "reports/bench/secure_aggregation.json").read_text())
    rows, c, q, u = bench["rows"], bench["secagg"]["clipping_range"], bench["secagg"]["quantization_range"], 2.0**-24
    bound = f"{2 * c / q + 10 * u * c:.1e}".replace("e-0", "e-")
    assert f"about 2c/Q + 10uc = {bound} with equal weights" in text

    def span(key, fmt, scale=1.0):
        lo, hi = (fmt.format(f(r[key] for r in rows) / scale) for f in (min, max))
        return f"{lo}-{hi}"

    assert f"{span('bound', '{:.1f}', 1e-5)}e-5 for the benchmark's unequal ones" in text
    errors, shares = span("max_abs_error_vs_plain_fedavg", "{:.1f}", 1e-6), span("error_over_bound", "{:.2f}")
    assert f"{errors}e-6 on the default and bart-base adapter sets, {shares} of the bound" in text
    clients = sorted({r["clients"] for r in rows})
    assert f"for {clients[0]} and {clients[1]} clients, one of them dropped or not" in text and len(clients) == 2
    assert {r["dropped"] is None for r in rows} == {True, False}
    up = {r["shape"].split(" ")[0]: r["bytes_up_per_client"] / 2**20 for r in rows}
    assert (
        f"({up['default']:.1f} MiB per client for the default adapters, {up['bart-base']:.0f} MiB for bart-base)"
        in text
    )


def test_the_privacy_docs_secagg_threshold_and_client_dp_margin_are_the_params_and_the_benchmarks_json():
    """docs/privacy.md: "0.67 of 3 shares survives one lost client" (params.yaml's reconstruction_threshold, the
    benchmark's 3-client rounds: threshold 2 of 3 shares, one dropped and still aggregated), the defaults "c = 8,
    Q = 2^22", and client-level DP's C' - C = sqrt(d) (2c/Q + 10uc), "about 0.009 for the default adapters, 0.023
    for bart-base's" (d: the benchmark's adapter parameters)."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    text = " ".join((root / "docs/privacy.md").read_text(encoding="utf-8").split())
    secagg = yaml.safe_load((root / "params.yaml").read_text())["privacy"]["secagg"]
    rows = json.loads((root / "reports/bench/secure_aggregation.json").read_text())["rows"]
    three = [r for r in rows if r["clients"] == 3]
    assert {(r["threshold"], r["num_shares"]) for r in three} == {(3 - 1, 3)}
    dropped = [r["in_sum"] for r in three if r["dropped"]]  # empty, all() held: no lost client was measured
    assert dropped and dropped == [2] * len(dropped) and secagg["num_shares"] == 1.0
    assert f"{secagg['reconstruction_threshold']:g} of 3 shares survives one lost client" in text
    c, q, u = secagg["clipping_range"], secagg["quantization_range"], 2.0**-24
    assert f"(c = {c:g}, Q = 2^{math.log2(q):.0f};" in text
    d = {r["shape"].split(" ")[0]: r["adapter_params"] for r in rows}
    margin = {k: math.sqrt(v) * (2 * c / q + 10 * u * c) for k, v in d.items()}
    assert f"(C' - C is about {margin['default']:.3f} for the default adapters, {margin['bart-base']:.3f} for" in text


def test_a_fractional_threshold_of_a_count_of_shares_is_refused_only_above_the_clients_of_a_round():
    """Flower's threshold of an integer num_shares is max(round(t x num_shares), 2): 0.67 x 5 = 3.35 -> 3 keys of 3
    clients runs; 0.67 x 7 = 4.69 -> 5 of 3 halted every round's setup (a run that trained nothing, found at its
    end), of 5 clients it runs."""
    from pipeline.experiments.privacy import SecAggConfig
    from pipeline.privacy.accounting import secure_sum_problem

    assert secure_sum_problem(SecAggConfig(num_shares=5), 3, 3, 1.0) is None
    assert secure_sum_problem(SecAggConfig(num_shares=7), 5, 5, 1.0) is None
    names(secure_sum_problem(SecAggConfig(num_shares=7), 3, 3, 1.0), "0.67", "num_shares 7", "= 5", "3 clients")


def test_secure_sum_problem_at_its_boundaries_by_hand():
    """Each refusal at its edge, by hand: 3 shares at t = 1.0 is round(3) = 3 keys > 2 clients, at t = 0.5 is
    max(round(1.5), 2) = 2 keys of 2; an integer threshold is Flower's count as given (3 of 5 shares, 4 clients);
    2 clients x Q = 2**31 is 2**32 exactly, which wraps the modulus; the largest Q for 3 is 2**32 // 3."""
    from pipeline.experiments.privacy import SecAggConfig
    from pipeline.privacy.accounting import secure_sum_problem

    assert secure_sum_problem(SecAggConfig(num_shares=3, reconstruction_threshold=1.0), 2, 2, 1.0) == (
        "privacy.secagg.reconstruction_threshold 1 of num_shares 3 = 3 > the 2 clients of a round's sum: none unmasks"
    )
    assert secure_sum_problem(SecAggConfig(num_shares=3, reconstruction_threshold=0.5), 2, 2, 1.0) is None
    assert secure_sum_problem(SecAggConfig(num_shares=5, reconstruction_threshold=3), 4, 4, 1.0) is None
    assert secure_sum_problem(SecAggConfig(quantization_range=2**31), 2, 2, 1.0) == (
        "privacy.secagg.quantization_range 2147483648 x 2 clients >= 2**32: the masked sum would wrap around; "
        "lower it below 2147483648"
    )
    assert secure_sum_problem(SecAggConfig(quantization_range=2**31 - 1), 2, 2, 1.0) is None
    assert secure_sum_problem(SecAggConfig(quantization_range=2**31), 3, 3, 1.0).endswith("below 1431655765")
    assert secure_sum_problem(SecAggConfig(), 2, 2, 1.0) is None  # 2 a round: the smallest sum that runs
    assert secure_sum_problem(SecAggConfig(), 3, 2, 0.99) == (
        "privacy.secure_aggregation needs at least 2 clients in every round's sum; 2 clients x train.fraction_train "
        "0.99 samples 1"
    )


@pytest.mark.parametrize(
    "entry, problem",
    [  # by hand: max(int(3 x 0.5), 1) = 1 upload a round; 3 x 2**31 = 1.5 x 2**32 wraps the masked sum
        ({"fraction_train": 0.5}, "3 clients x train.fraction_train 0.5 samples 1"),
        ({"privacy": {"secagg": {"quantization_range": 2**31}}}, "quantization_range 2147483648 x 3 clients"),
        # Flower's secaggplus_mod: 'Available neighbours number smaller than threshold' (3 keys < 4) in every round
        ({"privacy": {"secagg": {"reconstruction_threshold": 4}}}, "reconstruction_threshold 4 > the 3 clients"),
        # Flower's threshold of 7 shares: round(0.67 x 7) = 5 of 3 keys; every round halted, nothing trained
        ({"privacy": {"secagg": {"num_shares": 7}}}, "reconstruction_threshold 0.67 of num_shares 7 = 5 > the 3"),
    ],
)
def test_a_secagg_setting_the_plan_knows_cannot_run_is_refused_by_the_plan_stage(tmp_path, capsys, entry, problem):
    """The plan holds the clients (N = 3 on domain) and train.fraction_train: a SecAgg+ round of one upload, or a
    modulus N x Q cannot hold, is refused before any plan is written, not after dvc repro reached its train stage."""
    import yaml

    from pipeline.common.cli import run as run_cli
    from pipeline.plan import main as plan_main

    privacy, entry = (
        {"secure_aggregation": True} | entry.get("privacy", {}),
        {k: v for k, v in entry.items() if k != "privacy"},
    )
    params = _params(None) | {
        "experiments": {"sa": {"method": "fedavg", "partition": "domain/seed0", "privacy": privacy}}
    }
    params["experiments"]["sa"] |= entry
    (path := tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    assert run_cli(plan_main, ["--params", str(path), "--out", str(tmp_path / "plans")]) == 2
    err = capsys.readouterr().err.strip()
    assert "experiments.sa" in err and problem in err and "\n" not in err
    assert not (tmp_path / "plans").exists()
