"""Adapter transfer encodings (``train.transfer_dtype``), self-describing by tensor dtype: fp32 (exact), fp16,
int8 with one symmetric scale per tensor sent under ``<key>.int8_scale``. With ``reference`` (a state both sides
hold) the difference to it is encoded, so the int8 step follows the update rather than the weights (~1)."""

from __future__ import annotations

import torch

SCALE_SUFFIX = ".int8_scale"
INT8_LEVELS = 127  # symmetric grid -127..127
FP16_MAX = float(torch.finfo(torch.float16).max)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-tensor int8: (q int8, scale float32 scalar) with ``x ~= q * scale``; all zeros: scale 0."""
    x = x.detach().to(torch.float32)
    amax = x.abs().max() if x.numel() else torch.tensor(0.0)
    scale = (amax / INT8_LEVELS).to(torch.float32).reshape(())
    if float(scale) == 0.0:
        return torch.zeros_like(x, dtype=torch.int8), scale
    return torch.round(x / scale).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8), scale


def encode_state(
    state: dict[str, torch.Tensor], dtype: str = "fp32", reference: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Encode a float state dict for transfer (``dtype`` in fp32|fp16|int8), optionally as a delta to ``reference``."""
    if reference is not None and (missing := sorted(set(state) - set(reference))):
        raise ValueError(f"delta encoding: reference lacks key(s) {missing[:4]}")
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(SCALE_SUFFIX):
            raise ValueError(f"state key {key!r} ends with the reserved suffix {SCALE_SUFFIX!r}")
        if not torch.is_tensor(value) or not value.is_floating_point():
            raise ValueError(
                f"state key {key!r}: expected a floating-point tensor, got {getattr(value, 'dtype', type(value))}"
            )
        if not torch.isfinite(value).all():
            raise ValueError(f"state key {key!r}: contains NaN or inf; refusing to send it")
        x = value.detach().to("cpu", torch.float32)
        if reference is not None:
            if tuple(reference[key].shape) != tuple(value.shape):
                raise ValueError(
                    f"delta encoding: {key} has shape {tuple(value.shape)} but the reference "
                    f"{tuple(reference[key].shape)}"
                )
            x = x - reference[key].detach().to("cpu", torch.float32)
        if dtype == "fp32":
            out[key] = x.contiguous().clone()
        elif dtype == "fp16":
            amax = float(x.abs().max()) if x.numel() else 0.0
            if amax > FP16_MAX:
                raise ValueError(
                    f"state key {key!r}: |x| = {amax:.4g} exceeds the fp16 range ({FP16_MAX}); use fp32 or int8"
                )
            out[key] = x.to(torch.float16).contiguous()
        else:
            q, scale = quantize_int8(x)
            out[key] = q.contiguous()
            out[key + SCALE_SUFFIX] = scale
    return out


def decode_state(
    encoded: dict[str, torch.Tensor], reference: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Float32 state dict from :func:`encode_state`'s output (whatever its dtype); adds ``reference`` back when the
    sender encoded a delta against it."""
    scales = {k[: -len(SCALE_SUFFIX)]: v for k, v in encoded.items() if k.endswith(SCALE_SUFFIX)}
    out: dict[str, torch.Tensor] = {}
    for key, value in encoded.items():
        if key.endswith(SCALE_SUFFIX):
            if key[: -len(SCALE_SUFFIX)] not in encoded:
                raise ValueError(f"encoded state: scale {key!r} without its tensor")
            continue
        if value.dtype == torch.int8:
            if key not in scales:
                raise ValueError(f"encoded state: int8 tensor {key!r} has no {key + SCALE_SUFFIX!r}")
            # quantize_int8's is one finite number: another raised torch's RuntimeError here, or NaN weights
            if scales[key].numel() != 1 or not torch.isfinite(scales[key]).all():
                raise ValueError(f"encoded state: {key + SCALE_SUFFIX!r} is not one finite number: {scales[key]}")
            x = value.to(torch.float32) * scales[key].reshape(()).to(torch.float32)
        elif value.dtype in (torch.float16, torch.float32):
            if key in scales:
                raise ValueError(f"encoded state: {key!r} is {value.dtype} but has an int8 scale")
            x = value.to(torch.float32)
        else:
            raise ValueError(f"encoded state: {key!r} has dtype {value.dtype}; expected float32, float16 or int8")
        if reference is not None:
            if key not in reference:
                raise ValueError(f"delta decoding: reference lacks key {key!r}")
            x = x + reference[key].detach().to("cpu", torch.float32)
        out[key] = x
    return out
