"""Adapter transfer codec (pipeline/federation/compression.py): hand-computed cases, error bounds, Flower round trip."""

from __future__ import annotations

import pytest
import torch

from benchmarks.communication import encoded_nbytes, transfer_error_bound
from pipeline.federation.compression import (
    SCALE_SUFFIX,
    decode_state,
    encode_state,
    quantize_int8,
)
from pipeline.modeling.adapters import AdapterConfig, AdapterSet


def test_int8_hand_computed():
    # max|x| = 7.9375 = 127 * 0.0625, so s = 0.0625 exactly; x/s = [127, -16, 0, 1.5, 0.48]
    x = torch.tensor([7.9375, -1.0, 0.0, 0.09375, 0.03])
    q, s = quantize_int8(x)
    assert float(s) == 0.0625
    assert q.dtype == torch.int8
    assert q.tolist() == [127, -16, 0, 2, 0]  # 1.5 rounds half to even -> 2; 0.48 -> 0
    enc = encode_state({"w": x}, "int8")
    assert set(enc) == {"w", "w" + SCALE_SUFFIX}
    dec = decode_state(enc)["w"]
    assert dec.tolist() == [7.9375, -1.0, 0.0, 0.125, 0.0]
    err = (dec - x).abs()
    assert float(err.max()) == pytest.approx(0.03125)  # the tie case hits s/2 exactly
    assert float(err.max()) <= transfer_error_bound(enc, "w") == 0.03125 * (1 + 2.0**-13)


def test_int8_zero_tensor_is_exact_and_grid_is_symmetric():
    enc = encode_state({"z": torch.zeros(3, 2), "n": torch.tensor([-2.0, 1.0])}, "int8")
    assert float(enc["z" + SCALE_SUFFIX]) == 0.0
    assert torch.equal(decode_state(enc)["z"], torch.zeros(3, 2))
    assert enc["n"].tolist() == [-127, 64]  # -2 is the max magnitude -> -127 (never -128); 1/(2/127)=63.5 -> 64


def test_fp16_hand_computed_and_range():
    x = torch.tensor([1.0 + 2.0**-12, 1.0 + 2.0**-10, -3.5, 65504.0])
    enc = encode_state({"w": x}, "fp16")
    assert enc["w"].dtype == torch.float16
    dec = decode_state(enc)["w"]
    # 1 + 2^-12 is halfway below the next fp16 (1 + 2^-10 spacing) -> rounds to 1; the others are exact
    assert dec.tolist() == [1.0, 1.0 + 2.0**-10, -3.5, 65504.0]
    with pytest.raises(ValueError, match="fp16 range"):
        encode_state({"big": torch.tensor([7.0e4])}, "fp16")


def test_fp32_is_exact_copy():
    x = torch.randn(5, 4)
    enc = encode_state({"w": x}, "fp32")
    assert torch.equal(decode_state(enc)["w"], x)
    enc["w"].add_(1.0)  # a copy: the caller's tensor is untouched
    assert not torch.equal(enc["w"], x)
    # fp32 is the default encoding (train.transfer_dtype's default): exact, float32, no scales
    default = encode_state({"w": x.double()})
    assert set(default) == {"w"} and default["w"].dtype == torch.float32 and torch.equal(default["w"], x)


@pytest.mark.parametrize("dtype,bytes_per_value", [("fp32", 4), ("fp16", 2), ("int8", 1)])
def test_random_states_within_bounds_and_sizes(dtype, bytes_per_value):
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(64, 32, generator=g) * 0.05, "b": torch.randn(32, generator=g) + 1.0}
    enc = encode_state(state, dtype)
    dec = decode_state(enc)
    for key, x in state.items():
        assert dec[key].dtype == torch.float32 and dec[key].shape == x.shape
        assert float((dec[key] - x).abs().max()) <= transfer_error_bound(enc, key)
    scales = 4 * len(state) if dtype == "int8" else 0
    assert encoded_nbytes(enc) == bytes_per_value * (64 * 32 + 32) + scales


def test_delta_encoding_shrinks_int8_error_for_layernorm_like_weights():
    g = torch.Generator().manual_seed(1)
    reference = {"ln": 1.0 + 0.1 * torch.randn(256, generator=g)}
    state = {"ln": reference["ln"] + 1e-3 * torch.randn(256, generator=g)}  # one round's small update
    plain = decode_state(encode_state(state, "int8"))["ln"]
    enc_delta = encode_state(state, "int8", reference=reference)
    delta = decode_state(enc_delta, reference=reference)["ln"]
    err_plain = float((plain - state["ln"]).abs().max())
    err_delta = float((delta - state["ln"]).abs().max())
    assert err_delta <= transfer_error_bound(enc_delta, "ln") + 1e-7  # + float32 rounding of the addition
    # the delta's scale is ~max|update|/127 instead of ~max|w|/127: orders of magnitude smaller
    assert err_delta < err_plain / 50


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="'w'.*NaN"):
        encode_state({"w": torch.tensor([1.0, float("nan")])}, "int8")
    with pytest.raises(ValueError, match="floating-point"):
        encode_state({"w": torch.ones(2, dtype=torch.long)}, "fp16")
    with pytest.raises(ValueError, match="reserved suffix"):
        encode_state({"w" + SCALE_SUFFIX: torch.ones(2)}, "fp32")
    with pytest.raises(ValueError, match="no 'w.int8_scale'"):
        decode_state({"w": torch.ones(2, dtype=torch.int8)})
    with pytest.raises(ValueError, match="without its tensor"):
        decode_state({"v" + SCALE_SUFFIX: torch.tensor(1.0)})
    with pytest.raises(ValueError, match="reference lacks"):
        encode_state({"w": torch.ones(2)}, "int8", reference={})


def test_adapter_state_through_flower_arrayrecord():
    from flwr.app import ArrayRecord

    adapters = AdapterSet(64, AdapterConfig(top_k=2, bottleneck=128), [None, None])
    with torch.no_grad():
        for p in adapters.parameters():
            p.add_(0.01 * torch.randn_like(p))  # W_up starts at zero; make every tensor nonzero
    state = adapters.state()
    sizes = {}
    for dtype in ("fp32", "fp16", "int8"):
        record = ArrayRecord.from_torch_state_dict(encode_state(state, dtype))
        sizes[dtype] = record.count_bytes()
        received = decode_state(record.to_torch_state_dict())
        assert list(received) == list(state)  # same keys, same order: loadable by AdapterSet.load_state
        adapters.load_state(received)
        for key in state:
            assert float((received[key] - state[key]).abs().max()) <= transfer_error_bound(
                encode_state({key: state[key]}, dtype), key
            )
    n_values = sum(t.numel() for t in state.values())
    # payload shrinks with the bytes per value (container overhead per array is the same for all three)
    assert sizes["fp32"] - sizes["fp16"] == 2 * n_values
    # int8 saves one byte per value but adds one scalar scale array (4 bytes + ~160 bytes of record header) per tensor
    assert n_values - 200 * len(state) < sizes["fp16"] - sizes["int8"] < n_values


def test_fp16_error_bound_is_half_an_ulp_and_tight():
    # 1 + 2^-11 lies halfway between the fp16 neighbours 1 and 1 + 2^-10 and rounds to 1 (even): the error is
    # half a unit in the last place at magnitude 1, 2^-11, which the bound must cover without slack.
    x = torch.tensor([1.0 + 2.0**-11, -0.5, 0.25])
    enc = encode_state({"w": x}, "fp16")
    err = float((decode_state(enc)["w"] - x).abs().max())
    assert err == 2.0**-11
    assert err <= transfer_error_bound(enc, "w") <= err * 1.01
    assert transfer_error_bound(encode_state({"w": x}, "fp32"), "w") == 0.0


def test_empty_and_zero_tensors_travel_exactly():
    for dtype in ("fp32", "fp16", "int8"):
        enc = encode_state({"e": torch.zeros(0, 4), "z": torch.zeros(2)}, dtype)
        dec = decode_state(enc)
        assert dec["e"].shape == (0, 4) and torch.equal(dec["z"], torch.zeros(2))
        # exact; fp16's bound keeps only its subnormal term 2^-25
        assert transfer_error_bound(enc, "e") == transfer_error_bound(enc, "z") == (2.0**-25 if dtype == "fp16" else 0)
    enc = encode_state({"e": torch.zeros(0)}, "int8")
    assert float(enc["e" + SCALE_SUFFIX]) == 0.0 and encoded_nbytes(enc) == 4  # just the scale


def test_encoded_bytes_by_hand():
    enc = encode_state({"a": torch.ones(10), "b": torch.ones(2, 3)}, "int8")
    assert encoded_nbytes(enc) == 10 + 6 + 2 * 4  # one byte per value plus one float32 scale per tensor
    assert encoded_nbytes(encode_state({"a": torch.ones(10)}, "fp16")) == 20


def test_delta_encoding_round_trip_and_errors():
    reference = {"w": torch.tensor([1.0, 2.0, 3.0])}
    state = {"w": torch.tensor([1.5, 1.0, 3.0])}
    enc = encode_state(state, "fp16", reference=reference)
    assert enc["w"].tolist() == [0.5, -1.0, 0.0]  # the delta travels, not the state
    assert decode_state(enc, reference=reference)["w"].tolist() == [1.5, 1.0, 3.0]
    assert reference["w"].tolist() == [1.0, 2.0, 3.0]  # the reference is left as it was
    with pytest.raises(ValueError, match="reference.*'w'"):
        decode_state(enc, reference={"v": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"w.*\(3,\).*\(2,\)"):
        encode_state(state, "int8", reference={"w": torch.zeros(2)})


def test_malformed_encodings_are_named():
    with pytest.raises(ValueError, match="'w'.*float16"):
        decode_state({"w": torch.ones(2, dtype=torch.float16), "w" + SCALE_SUFFIX: torch.tensor(1.0)})
    with pytest.raises(ValueError, match="'w'.*int32"):
        decode_state({"w": torch.ones(2, dtype=torch.int32)})
    with pytest.raises(ValueError, match="'w'.*NaN"):
        encode_state({"w": torch.tensor([float("inf")])}, "fp32")
    with pytest.raises(ValueError, match=r"'w'.*7e\+04.*fp16"):
        encode_state({"w": torch.tensor([-7.0e4, 1.0])}, "fp16")  # the magnitude, whatever the sign


def test_int8_scale_of_exactly_one_and_any_input_precision():
    # max|x| = 127 gives s = 1 exactly: q is x rounded, not a special case
    q, s = quantize_int8(torch.tensor([127.0, -3.4, 0.5]))
    assert float(s) == 1.0 and q.tolist() == [127, -3, 0]
    # the codec works in float32 whatever the sender's precision: bf16 / float64 states encode like their float32 copy
    x = torch.tensor([0.7, -0.3, 0.011, 1.3])
    for dtype in (torch.bfloat16, torch.float64):
        ref = x.to(dtype).to(torch.float32)
        q_d, s_d = quantize_int8(x.to(dtype))
        q_r, s_r = quantize_int8(ref)
        assert torch.equal(q_d, q_r) and float(s_d) == float(s_r)
        for codec in ("fp32", "fp16"):
            enc = encode_state({"w": x.to(dtype)}, codec)
            assert enc["w"].dtype == (torch.float32 if codec == "fp32" else torch.float16)
            assert torch.equal(decode_state(enc)["w"], decode_state(encode_state({"w": ref}, codec))["w"])


def test_input_errors_name_the_key_and_what_is_wrong():
    with pytest.raises(ValueError, match=r"'w'.*torch.int64"):
        encode_state({"w": torch.ones(2, dtype=torch.long)}, "fp32")
    with pytest.raises(ValueError, match=r"'w'.*list"):
        encode_state({"w": [1.0, 2.0]}, "fp32")
    state = {k: torch.ones(1) for k in "abcde"}
    with pytest.raises(ValueError, match=r"\['a', 'b', 'c', 'd'\]"):
        encode_state(state, "int8", reference={})  # the first four of five, sorted


def test_delta_decoding_returns_float32_whatever_the_reference_precision():
    reference = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    dec = decode_state(encode_state({"w": torch.tensor([1.5, 2.0])}, "fp32", reference=reference), reference=reference)
    assert dec["w"].dtype == torch.float32 and dec["w"].tolist() == [1.5, 2.0]


def test_the_int8_bound_covers_the_float32_rounding_of_x_over_s_and_q_times_s():
    # s = fl(36.96.../127); 12.66.../s lies within float32 rounding of a half step: round(fl(x/s)) and fl(q*s) put
    # the decoded value 0.1455154 from x (float64), above s/2 = 0.1455150: the 'guaranteed' bound was exceeded
    x = torch.tensor([-float.fromhex("0x1.27afb6p+5"), float.fromhex("0x1.951d16p+3")])
    enc = encode_state({"w": x}, "int8")
    s = float(enc["w" + SCALE_SUFFIX])
    err = float((decode_state(enc)["w"].double() - x.double()).abs().max())
    assert s / 2 < err <= transfer_error_bound(enc, "w") <= s / 2 * (1 + 2.0**-12)


def test_int8_grid_stays_symmetric_when_the_scale_is_subnormal():
    """A subnormal scale (max|x| below 127 * 2^-126) is rounded by float32 with a large relative error: here
    fl(190 * 2^-149 / 127) = 2^-149, so x/s = +-190, past the grid. Clamping keeps q on -127..127 with x's sign; without
    it the cast to int8 wraps 190 to -66 (the sign flips) and -190 to 66."""
    tiny = 2.0**-149  # the smallest float32 subnormal; integer multiples of it below 2^-126 are exact
    x = torch.tensor([190 * tiny, -190 * tiny, 64 * tiny])
    q, s = quantize_int8(x)
    assert float(s) == tiny
    assert q.tolist() == [127, -127, 64]
    # the clamped values are off by 63 * 2^-149, far past s/2: the benchmarks' bound holds them too
    enc = encode_state({"w": x}, "int8")
    err = float((decode_state(enc)["w"].double() - x.double()).abs().max())
    assert err == 63 * tiny <= transfer_error_bound(enc, "w") <= 65 * tiny


def test_the_int8_scale_is_float32_whatever_torchs_default_dtype():
    """The scale travels as one float32 (4 bytes, encoded_nbytes counts them) also for an empty tensor, whose max is
    made by torch.tensor(0.0) in torch's default dtype: under float64 it must not become a float64 scale."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _, s = quantize_int8(torch.zeros(0, dtype=torch.float32))
        enc = encode_state({"e": torch.zeros(0, dtype=torch.float32)}, "int8")
    finally:
        torch.set_default_dtype(previous)
    assert s.dtype == torch.float32 and s.shape == () and float(s) == 0.0
    assert enc["e" + SCALE_SUFFIX].dtype == torch.float32 and encoded_nbytes(enc) == 4
