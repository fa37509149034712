"""Bytes per round per client, measured on the Flower messages themselves.

A round moves, per sampled client, one ``train`` instruction down (the global adapter + config) and one reply up
(the local adapter + counts); the evaluate messages of fedmeet's methods carry no arrays. Each message is built
like ``pipeline.federation.client_app`` builds it (``ArrayRecord.from_torch_state_dict`` under ``arrays``, a
``ConfigRecord`` down, a ``MetricRecord`` of counts up) and measured three ways:
- ``wire_bytes``: Flower's own serialisation, what a SuperNode/SuperLink pushes: the message is an inflatable
  object tree (message -> record dict -> records -> arrays -> array chunks), each object sent as its
  ``deflate()`` bytes (header + protobuf body), identical objects once (content-addressed);
- ``record_bytes``: ``ArrayRecord.count_bytes()``, what ``pipeline.federation.server_app`` logs as bytes_up/bytes_down;
- ``tensor_bytes``: the raw tensor bytes.
Full-model FedAvg moves every backbone parameter (tied weights once) both ways in fp32.
"""

from __future__ import annotations

from typing import get_args

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from benchmarks.common import Shape, build_summarizer
from pipeline.experiments.train_config import TransferDtype
from pipeline.federation.compression import SCALE_SUFFIX, decode_state, encode_state
from pipeline.federation.engines import _set_server_identity
from pipeline.federation.protocol import ARRAYS_KEY, CONFIG_KEY, METRICS_KEY
from pipeline.federation.strategies.registry import NUM_EXAMPLES_KEY, NUM_STEPS_KEY


def encoded_nbytes(encoded: dict[str, torch.Tensor]) -> int:
    """Raw tensor bytes of an encoded state (no container overhead)."""
    return sum(t.numel() * t.element_size() for t in encoded.values())


def transfer_error_bound(encoded: dict[str, torch.Tensor], key: str) -> float:
    """Guaranteed max |decoded - original| for ``key``: 0 for fp32; int8: s/2 + s 2^-14 (float32 rounds x/s and q*s,
    < 127 s 2^-23 each), plus 127 * 2^-150 for a subnormal s (float32 rounds s itself by up to 2^-150, so x/s may pass
    127 and be clamped: |127 s - x| <= 127 * 2^-150); fp16: half a unit in the last place at the largest magnitude
    (2^-11 relative, plus 2^-25 absolute for subnormals; the factor 1 + 2^-10 covers measuring the magnitude after
    rounding)."""
    value = encoded[key]
    if value.dtype == torch.int8:
        s = float(encoded[key + SCALE_SUFFIX])
        return s * (0.5 + 2.0**-14) + (127 * 2.0**-150 if 0 < s < 2.0**-126 else 0.0)
    if value.dtype == torch.float16:
        amax = float(value.float().abs().max()) if value.numel() else 0.0
        return amax * 2.0**-11 * (1 + 2.0**-10) + 2.0**-25
    return 0.0


def wire_bytes(message: Message) -> int:
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


def round_messages(down_state: dict[str, torch.Tensor], up_state: dict[str, torch.Tensor]) -> tuple[Message, Message]:
    """A train instruction carrying ``down_state`` and the client's reply carrying ``up_state``."""
    _set_server_identity(run_id=1)
    down_arrays = ArrayRecord.from_torch_state_dict(down_state)
    config = ConfigRecord({"server-round": 1, "plan": "models/plans/experiment.json"})
    down = Message(RecordDict({ARRAYS_KEY: down_arrays, CONFIG_KEY: config}), dst_node_id=2, message_type="train")
    metrics = MetricRecord(
        {  # the keys pipeline.federation.client_app.client_train replies with (counts and losses only)
            NUM_EXAMPLES_KEY: 200,
            NUM_STEPS_KEY: 50,
            "num-tokens": 12000,
            "train-loss": 3.1,
            "ce": 3.2,
            "kd": 0.4,
            "kd-fraction": 0.3,
            "proximal": 0.0,
        }
    )
    up = Message(
        RecordDict({ARRAYS_KEY: ArrayRecord.from_torch_state_dict(up_state), METRICS_KEY: metrics}), reply_to=down
    )
    return down, up


def measure(down_state, up_state) -> dict:
    down, up = round_messages(down_state, up_state)
    d, u = wire_bytes(down), wire_bytes(up)
    return {
        "down_wire_bytes": d,
        "up_wire_bytes": u,
        "round_wire_bytes": d + u,
        "down_record_bytes": down.content[ARRAYS_KEY].count_bytes(),
        "up_record_bytes": up.content[ARRAYS_KEY].count_bytes(),
        "up_tensor_bytes": encoded_nbytes(up_state),
    }


def codec_error(state: dict[str, torch.Tensor], dtype: str, reference: dict[str, torch.Tensor] | None) -> dict:
    """Round-trip error of ``state`` (max |error|, its ratio to the guaranteed bound, relative L2 error)."""
    enc = encode_state(state, dtype, reference)
    dec = decode_state(enc, reference)
    max_err = max(float((dec[k] - state[k]).abs().max()) for k in state)
    worst_ratio = max(
        float((dec[k] - state[k]).abs().max()) / b if (b := transfer_error_bound(enc, k)) > 0 else 0.0 for k in state
    )
    num = sum(float(((dec[k] - state[k]) ** 2).sum()) for k in state)
    den = sum(float((state[k] ** 2).sum()) for k in state)
    return {
        "max_abs_error": max_err,
        "max_error_over_bound": round(worst_ratio, 4),
        "relative_l2_error": (num / den) ** 0.5,
    }


def bench_communication(shape: Shape) -> dict:
    model = build_summarizer(shape)  # adapters perturbed: "trained", nonzero, local != global
    local, global_ = model.adapter_state("local"), model.adapter_state("global")
    n_adapter = sum(t.numel() for t in local.values())
    full = {name: p.detach() for name, p in model.backbone.named_parameters()}  # tied weights appear once
    n_full = sum(t.numel() for t in full.values())

    full_fp32 = measure(full, full)
    adapters = {}
    for dtype in get_args(TransferDtype):
        m = measure(encode_state(global_, dtype), encode_state(local, dtype))
        m["full_model_over_adapter"] = round(full_fp32["round_wire_bytes"] / m["round_wire_bytes"], 2)
        m["error_weights"] = codec_error(local, dtype, None)
        m["error_delta_to_global"] = codec_error(local, dtype, global_)
        adapters[dtype] = m
    return {
        "shape": shape,
        "adapter_parameters": n_adapter,
        "backbone_parameters": n_full,
        "parameter_ratio": round(n_full / n_adapter, 2),
        "full_model_fedavg_fp32": full_fp32,
        "adapters": adapters,
        "serialisation": "Flower inflatable-object tree: sum of deflate() bytes of every nested object "
        "(flwr.supercore.inflatable.get_all_nested_objects), as pushed by SuperNode/SuperLink",
    }
