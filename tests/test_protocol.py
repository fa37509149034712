"""What travels between server and clients (pipeline.federation.protocol): the plan a message refers to, the
adapters on the wire in each transfer encoding, the byte counts and the privacy report.

Properties stated: the plan comes from node config, then run config, then the message, and is re-read when its
file changes; what a client decodes is the server's global within the codec's bound (exactly for fp32) and what
the server decodes is the client's adapter within the bound of the encoded difference; delta encoding is used
only where it helps (a lossy encoding with train.transfer_delta), against the round-0 adapter downstream and the
received global upstream; a privacy report's -1 means unbounded.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

# imported here, not only in the tests: mutmut's fork server imports the test modules once
import pipeline.federation.engines  # noqa: F401,E402
import pipeline.federation.protocol  # noqa: F401,E402
import pipeline.training.shared_model  # noqa: F401,E402
from tests.errors import names
from tests.test_federated import workspace, write_plan, ws  # noqa: F401  (fixtures)


def _context(node: dict | None = None, run: dict | None = None) -> Context:
    return Context(run_id=1, node_id=7, node_config=node or {}, state=RecordDict(), run_config=run or {})


def _message(config: dict | None) -> Message:
    from pipeline.federation.engines import _set_server_identity

    _set_server_identity(1)
    content = RecordDict({"config": ConfigRecord(config)}) if config is not None else RecordDict()
    return Message(content, dst_node_id=7, message_type="train")


# ----------------------------------------------------------------------------------------------- the plan
def test_the_plan_comes_from_node_config_then_run_config_then_the_message():
    from pipeline.federation.protocol import plan_path_of

    msg = _message({"plan": "msg.json"})
    assert plan_path_of(msg, _context({"plan": "node.json"}, {"plan": "run.json"})) == "node.json"
    assert plan_path_of(msg, _context({"plan": ""}, {"plan": "run.json"})) == "run.json"
    assert plan_path_of(msg, _context({}, {})) == "msg.json"
    assert plan_path_of(msg, _context({"client-name": "A"}, {"other": 1})) == "msg.json"
    for msg in (None, _message(None), _message({"server-round": 1}), _message({"plan": ""})):
        with pytest.raises(ValueError) as err:
            plan_path_of(msg, _context())
        names(err.value, "node_config 'plan'", "run_config 'plan'")


def test_a_plan_is_read_once_per_file_version(ws):
    from pipeline.federation.protocol import load_plan

    path = write_plan("protocol-plan", "fedavg", rounds=2)
    first = load_plan(path)
    assert load_plan(path) is first  # not read again
    assert load_plan(str(Path(path).resolve())) is first  # the same file by another name
    write_plan("protocol-plan", "fedavg", rounds=5)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a new version, whatever the clock
    assert load_plan(path).train.rounds == 5
    with pytest.raises(FileNotFoundError) as err:
        load_plan("models/plans/none.json")
    names(err.value, "models/plans/none.json")


# ----------------------------------------------------------------------------------------------- adapters
def _plan(dtype: str, delta: bool):
    from pipeline.federation.protocol import load_plan

    return load_plan(write_plan(f"protocol-{dtype}-{int(delta)}", "fedavg", transfer_dtype=dtype, transfer_delta=delta))


def _bound(encoded: dict[str, torch.Tensor], key: str) -> float:
    from benchmarks.communication import transfer_error_bound

    return transfer_error_bound(encoded, key)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("delta", [False, True])
def test_the_client_decodes_the_servers_global_within_the_codec_bound(ws, dtype, delta):
    from pipeline.federation.protocol import decode_global, downlink_reference, encode_global
    from pipeline.training.shared_model import initial_adapter_state

    plan = _plan(dtype, delta)
    w0 = initial_adapter_state(plan)
    reference = downlink_reference(plan)
    if dtype != "fp32" and delta:  # the round-0 adapter, which every node derives from the seed
        assert reference.keys() == w0.keys() and all(torch.equal(reference[k], w0[k]) for k in w0)
    else:
        assert reference is None
    g = torch.Generator().manual_seed(0)
    glob = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    record = encode_global(glob, plan)
    encoded = record.to_torch_state_dict()
    decoded = decode_global(record, plan)
    wire = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}[dtype]
    assert all(encoded[k].dtype == wire for k in glob)  # the plan's transfer dtype on the wire
    for k, v in glob.items():
        err = float((decoded[k] - v).abs().max())
        assert decoded[k].dtype == torch.float32
        if dtype == "fp32":
            assert err == 0.0
        else:  # the codec's bound, plus float32 rounding when the reference is added back
            assert err <= _bound(encoded, k) + (2**-23 * float(v.abs().max()) if delta else 0.0)
        if delta and dtype != "fp32":  # the difference to the round-0 adapter was sent: its bound is small
            assert _bound(encoded, k) <= 0.01 * 5 / (127 if dtype == "int8" else 1000)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("delta", [False, True])
def test_the_server_decodes_the_clients_adapter_within_the_bound_of_what_was_encoded(ws, dtype, delta):
    from pipeline.federation.protocol import decode_reply, encode_reply
    from pipeline.training.shared_model import initial_adapter_state

    plan = _plan(dtype, delta)
    g = torch.Generator().manual_seed(1)
    received = {k: v + torch.randn(v.shape, generator=g) for k, v in initial_adapter_state(plan).items()}
    update = {k: 1e-3 * torch.randn(v.shape, generator=g) for k, v in received.items()}
    local = {k: received[k] + update[k] for k in received}
    diff = {k: local[k] - received[k] for k in local}  # the update as float32 arithmetic leaves it
    record = encode_reply(local, plan, received)
    encoded = record.to_torch_state_dict()
    decoded_record = decode_reply(record, plan, received)
    decoded = decoded_record.to_torch_state_dict()
    # what the strategy aggregates: the decoded state's own record, byte for byte
    assert [a.data for a in decoded_record.values()] == [
        a.data for a in ArrayRecord.from_torch_state_dict(decoded).values()
    ]
    for k in local:
        err = float((decoded[k] - local[k]).abs().max())
        if dtype == "fp32":
            assert err == 0.0 and torch.equal(encoded[k], local[k])  # the state itself, never a difference
        else:
            # the codec's bound on what was encoded, plus float32 rounding of the difference and of adding the
            # received global back (half an ulp of the adapter's magnitude each)
            rounding = 2**-23 * float(local[k].abs().max()) if delta else 0.0
            assert err <= _bound(encoded, k) + rounding
            amax = float(diff[k].abs().max()) if delta else float(local[k].abs().max())
            # the scale follows what was encoded: the update with delta, the adapter itself without
            if dtype == "int8":
                assert float(encoded[k + ".int8_scale"]) == pytest.approx(amax / 127, rel=1e-6)
            else:
                torch.testing.assert_close(encoded[k].float(), diff[k] if delta else local[k], rtol=2**-11, atol=2**-25)


@pytest.mark.parametrize("scale", [torch.zeros(3), torch.zeros(0), torch.tensor(float("nan"))])
def test_a_reply_whose_int8_scale_is_not_one_finite_number_is_undecodable(ws, scale):
    """What the server catches (ValueError: that client's failure for the round): a scale of several or no values
    raised torch's RuntimeError in reshape, ending the server's run; a NaN one decoded to NaN weights, which FedAvg
    averaged into every client's global."""
    from pipeline.federation.protocol import decode_reply
    from pipeline.training.shared_model import initial_adapter_state

    plan = _plan("int8", False)
    sent = initial_adapter_state(plan)
    encoded = {k: torch.zeros(v.shape, dtype=torch.int8) for k, v in sent.items()}
    encoded |= {k + ".int8_scale": scale for k in sent}
    with pytest.raises(ValueError) as err:
        decode_reply(ArrayRecord.from_torch_state_dict(encoded), plan, sent)
    names(err.value, f"{next(iter(sent))}.int8_scale")


@pytest.mark.parametrize("dtype, delta", [("fp32", False), ("fp16", False), ("fp16", True)])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_reply_holding_nan_or_inf_weights_is_undecodable(ws, dtype, delta, value):
    """No client sends a non-finite weight (compression.encode_state refuses to): one that does is its client's
    failure for the round (ValueError naming the array). Before, FedAvg averaged it into the global, which the
    server then refused to send in the next round (a ValueError naming no client ended its run), or, in the last
    round, saved as the run's adapter."""
    from pipeline.federation.protocol import decode_reply
    from pipeline.training.shared_model import initial_adapter_state

    plan = _plan(dtype, delta)
    sent = initial_adapter_state(plan)
    key = sorted(sent)[-1]
    wire = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    encoded = {k: (v - sent[k] if delta else v).to(wire) for k, v in sent.items()}
    encoded[key] = encoded[key].clone()
    encoded[key].view(-1)[-1] = value
    with pytest.raises(ValueError) as err:
        decode_reply(ArrayRecord.from_torch_state_dict(encoded), plan, sent)
    names(err.value, key, "NaN or inf")
    encoded[key].view(-1)[-1] = 0.5  # the same reply with a finite weight there decodes to it
    decoded = decode_reply(ArrayRecord.from_torch_state_dict(encoded), plan, sent).to_torch_state_dict()
    assert decoded[key].view(-1)[-1] == torch.tensor(0.5) + (sent[key].view(-1)[-1] if delta else 0.0)


def test_a_reply_whose_bytes_are_not_the_arrays_it_declares_is_undecodable(ws):
    """The strategy aggregates what an Array's bytes hold (np.load), not the shape it declares: one declaring the
    adapter's shape but holding one row was broadcast over every row of FedAvg's mean (or, its reply first, numpy's
    ValueError ended the server's run); truncated bytes or another serialisation raised there too."""
    from flwr.app import Array

    from pipeline.federation.protocol import decode_reply
    from pipeline.training.shared_model import initial_adapter_state

    plan = _plan("fp32", False)
    sent = initial_adapter_state(plan)
    key = next(iter(sent))
    shape, one_row = tuple(sent[key].shape), Array(sent[key][:1].numpy())
    truncated = Array(sent[key].numpy())
    for odd in (
        Array(dtype=one_row.dtype, shape=shape, stype=one_row.stype, data=one_row.data),
        Array(dtype=truncated.dtype, shape=shape, stype=truncated.stype, data=truncated.data[:-4]),
        Array(dtype=truncated.dtype, shape=shape, stype="torch.Tensor", data=truncated.data),
    ):
        record = ArrayRecord.from_torch_state_dict(sent)
        record[key] = odd
        with pytest.raises(ValueError) as err:
            decode_reply(record, plan, sent)
        names(err.value, key)


@pytest.mark.parametrize("dtype", ["<U1", "S4", "datetime64[s]", "V4"])
def test_a_reply_array_of_a_dtype_torch_cannot_hold_is_undecodable(ws, dtype):
    """An array of the adapter's shape holding text, bytes, dates or raw records: its client's failure for the
    round (ValueError naming the array); before, torch's TypeError ("can't convert np.ndarray of type ...") left
    decode_reply, which the server does not catch, ending its run naming no client."""
    import numpy as np
    from flwr.app import Array

    from pipeline.federation.protocol import decode_reply
    from pipeline.training.shared_model import initial_adapter_state

    plan = _plan("fp32", False)
    sent = initial_adapter_state(plan)
    key = sorted(sent)[-1]
    record = ArrayRecord.from_torch_state_dict(sent)
    record[key] = Array(np.zeros(tuple(sent[key].shape), dtype=dtype))
    with pytest.raises(ValueError) as err:
        decode_reply(record, plan, sent)
    names(err.value, key, dtype.lstrip("<"))
    record[key] = Array(sent[key].numpy().astype(np.float16))  # a float16 one is decoded, as before
    assert torch.equal(decode_reply(record, plan, sent).to_torch_state_dict()[key], sent[key].half().float())


def test_payload_bytes_count_every_array_record_and_nothing_else(ws):
    from flwr.app import Array

    from pipeline.federation.protocol import payload_bytes

    assert payload_bytes(RecordDict({"metrics": MetricRecord({"x": 1.0})})) == 0
    one = ArrayRecord({"w": Array(torch.zeros(10).numpy())})
    two = ArrayRecord({"v": Array(torch.zeros(30).numpy())})
    assert payload_bytes(RecordDict({"a": one})) == one.count_bytes() >= 40
    assert payload_bytes(RecordDict({"a": one, "b": two, "m": MetricRecord({"x": 1.0})})) == (
        one.count_bytes() + two.count_bytes()
    )


# ----------------------------------------------------------------------------------------------- privacy
def _privacy(**kw) -> MetricRecord:
    m = {
        "dp-epsilon": 2.5,
        "dp-delta": 1e-5,
        "dp-noise-multiplier": 1.1,
        "dp-max-grad-norm": 0.5,
        "dp-sample-rate": 0.25,
        "dp-steps": 12,
        "dp-examples": 8,
        "dp-clipped": 2,
    }
    m.update(kw)
    return MetricRecord(m)


def test_a_privacy_report_becomes_a_history_row():
    from types import SimpleNamespace

    from pipeline.common.config import from_dict
    from pipeline.experiments.privacy import PrivacyConfig
    from pipeline.federation import protocol

    example = from_dict(PrivacyConfig, {"mode": "example", "noise_multiplier": 1.0}, "privacy")
    trained = {"num-examples": 8, "num-trained": 8, "num-steps": 2, "num-tokens": 80, "train-loss": 1.0, "ce": 1.0}
    trained |= {"kd": 0.0, "kd-fraction": 0.0, "proximal": 0.0}

    def privacy_row(m):  # as the server reads a train reply under example-level DP: its DP_METRICS' fields
        row = protocol.train_reply_row(MetricRecord(dict(m) | trained), SimpleNamespace(privacy=example))
        return {k: v for k, v in row.items() if k not in {field for field, *_ in protocol.TRAIN_METRICS.values()}}

    assert privacy_row(_privacy()) == {
        "epsilon": 2.5,
        "delta": 1e-5,
        "noise_multiplier": 1.1,
        "max_grad_norm": 0.5,
        "sample_rate": 0.25,
        "dp_steps": 12,
        "dp_examples": 8,
        "dp_clipped": 2,
        "clipped_fraction": 0.25,
    }
    unbounded = privacy_row(_privacy(**{"dp-epsilon": -1.0, "dp-max-grad-norm": -1.0}))
    assert unbounded["epsilon"] is None and unbounded["max_grad_norm"] is None
    zero = privacy_row(_privacy(**{"dp-epsilon": 0.0, "dp-examples": 0, "dp-clipped": 0}))
    assert zero["epsilon"] == 0.0 and zero["clipped_fraction"] == 0.0  # 0 is a bound; no examples, no fraction
    assert type(zero["dp_steps"]) is int and type(zero["delta"]) is float


@pytest.mark.parametrize(
    "key, value",
    [
        ("dp-noise-multiplier", float("nan")),
        ("dp-noise-multiplier", float("inf")),
        ("dp-noise-multiplier", -1.1),
        ("dp-sample-rate", 2.0),
        ("dp-sample-rate", float("nan")),
        ("dp-sample-rate", -0.25),
        ("dp-delta", float("nan")),
        ("dp-delta", 2.0),
        ("dp-delta", -1e-5),
        ("dp-epsilon", float("nan")),
        ("dp-epsilon", float("inf")),
        ("dp-epsilon", -2.0),
        ("dp-max-grad-norm", float("nan")),
        ("dp-max-grad-norm", float("inf")),
    ],
)
def test_a_privacy_report_out_of_range_is_a_malformed_reply(key, value):
    """A DP-SGD report's floats are a client's ClientPrivacy and its accountant's epsilon: finite (-1 the mark of an
    unbounded epsilon or C), the noise multiplier >= 0, the sampling rate and delta probabilities. A reply holding
    another is malformed (its client's failure), not recorded: the run record puts the reported settings through
    opacus' accountant (seam.run_record names the accountant of the largest epsilon), which raises on a sampling
    rate above 1 (math domain error) and does not return on a NaN or infinite noise multiplier, after every round."""
    from types import SimpleNamespace

    from pipeline.common.config import from_dict
    from pipeline.experiments.privacy import PrivacyConfig
    from pipeline.federation import protocol

    example = SimpleNamespace(privacy=from_dict(PrivacyConfig, {"mode": "example", "noise_multiplier": 1.0}, "p"))
    trained = {"num-examples": 8, "num-trained": 8, "num-steps": 2, "num-tokens": 80, "train-loss": 1.0, "ce": 1.0}
    trained |= {"kd": 0.0, "kd-fraction": 0.0, "proximal": 0.0}
    assert protocol.train_reply_row(MetricRecord(dict(_privacy()) | trained), example)["sample_rate"] == 0.25
    with pytest.raises(ValueError, match=rf"no single number of their type: {{'{key}': {value}}}"):
        protocol.train_reply_row(MetricRecord(dict(_privacy(**{key: value})) | trained), example)


@pytest.mark.parametrize("key, field", [("dp-epsilon", "epsilon"), ("dp-max-grad-norm", "max_grad_norm")])
def test_only_minus_one_marks_an_unbounded_privacy_report(key, field):
    """-1 is seam.account's mark of an unbounded epsilon or C and reads as None; another negative (-0.5) is no
    epsilon or norm at all, so the reply is malformed rather than recorded as unbounded."""
    from types import SimpleNamespace

    from pipeline.common.config import from_dict
    from pipeline.experiments.privacy import PrivacyConfig
    from pipeline.federation import protocol

    example = SimpleNamespace(privacy=from_dict(PrivacyConfig, {"mode": "example", "noise_multiplier": 1.0}, "p"))
    trained = {"num-examples": 8, "num-trained": 8, "num-steps": 2, "num-tokens": 80, "train-loss": 1.0, "ce": 1.0}
    trained |= {"kd": 0.0, "kd-fraction": 0.0, "proximal": 0.0}
    assert protocol.train_reply_row(MetricRecord(dict(_privacy(**{key: -1.0})) | trained), example)[field] is None
    with pytest.raises(ValueError, match=rf"a negative other than -1 .*'{field}': -0.5"):
        protocol.train_reply_row(MetricRecord(dict(_privacy(**{key: -0.5})) | trained), example)


def test_fp32_never_sends_a_delta_even_when_a_plan_asks_for_one(ws):
    """A hand-written plan with fp32 and train.transfer_delta: fp32 is exact, so no delta is taken (it could only
    add float32 rounding): no downlink reference, the client decodes the global bit for bit."""
    import json
    from pathlib import Path

    from pipeline.federation.protocol import decode_global, downlink_reference, encode_global, load_plan
    from pipeline.training.shared_model import initial_adapter_state

    path = write_plan("protocol-fp32-handdelta", "fedavg", transfer_dtype="fp32")
    raw = json.loads(Path(path).read_text())
    raw["train"]["transfer_delta"] = True
    Path(path).write_text(json.dumps(raw, indent=2, sort_keys=True))
    plan = load_plan(path)
    assert plan.train.transfer_delta is True and downlink_reference(plan) is None
    glob = {k: v + 0.1 for k, v in initial_adapter_state(plan).items()}
    decoded = decode_global(encode_global(glob, plan), plan)
    assert all(torch.equal(decoded[k], v) for k, v in glob.items())
