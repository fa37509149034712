"""Analytic matmul FLOPs of one training step, per example, from the shapes alone.

A matmul of [a x b] by [b x c] costs 2abc FLOPs. Per example (S source, T target tokens, hidden n, ffn f, vocab V,
adapter bottleneck m, L_e encoder and L_d decoder layers, adapters on the top k decoder layers):

  encoder layer        S(8n^2 + 4nf) + 4 S^2 n          Q,K,V,O projections; FFN; QK^T and AV
  decoder layer        T(8n^2 + 4n^2 + 4nf) + 4T^2 n + 4TSn + 4Sn^2
                       self-attn proj.; cross Q,O; FFN; self QK^T, AV; cross QK^T, AV; cross K,V of the source
  adapter              4Tnm                               W_down, W_up
  LM head              2TnV (+ 2Tn^2 for BERT's dense transform)
  BERT encoder pooler  2n^2 (dense on [CLS]; computed by the HF forward though nothing uses it)

Backward. The whole backbone is frozen, so autograd never goes below the first adapted layer: nothing under it
requires a gradient. Inside the top k layers the frozen matmuls need activation gradients (dX, as many FLOPs as
their forward) but no weight gradients; the adapters need both (2x forward), except W_down of the lowest adapter,
whose input does not require a gradient (no dX there). The lowest adapted layer's own frozen sub-layers and every
cross-attention K,V projection read only non-differentiable inputs: no backward at all. Self-attention's QK^T and AV
need gradients of both operands (2x forward); cross-attention's only of the query side (1x). The LM head needs dX. The
backward is therefore the same for all three variants (it never reaches the encoder); what differs is the forward: naive
= 2 full forwards, shared encoder = 1 encoder + 2 decoders, prefix = 2 x (top k layers + head). Non-matmul work
(softmax, LayerNorm, GELU, the loss over V) is not counted: it is memory-bound and is what the measured time adds on top
of the FLOP bound. ``attn=False`` leaves out the attention products (QK^T, AV) too, which is what
``torch.utils.flop_counter`` sees when attention runs in a fused SDPA kernel it does not count.
"""

from __future__ import annotations

from benchmarks.common import Shape


def encoder_layer(s: Shape, attn: bool = True) -> float:
    n, f, S = s.hidden, s.ffn, s.source_length
    return S * (8 * n * n + 4 * n * f) + attn * 4 * S * S * n


def decoder_layer_tokens(s: Shape, attn: bool = True) -> float:
    """The part of a decoder layer that runs per target token (everything but the cross K,V projections)."""
    n, f, S, T = s.hidden, s.ffn, s.source_length, s.target_length
    return T * (12 * n * n + 4 * n * f) + attn * (4 * T * T * n + 4 * T * S * n)


def cross_kv(s: Shape) -> float:
    return 4 * s.source_length * s.hidden**2


def decoder_layer(s: Shape, attn: bool = True) -> float:
    return decoder_layer_tokens(s, attn) + cross_kv(s)


def adapter(s: Shape) -> float:
    return 4 * s.target_length * s.hidden * s.bottleneck


def head(s: Shape) -> float:
    t, n = s.target_length, s.hidden
    return 2 * t * n * s.vocab + (2 * t * n * n if s.head_transform else 0)


def encoder(s: Shape, attn: bool = True) -> float:
    pooler = 2 * s.hidden**2 if s.arch == "bert2bert" else 0  # BertModel's pooler: dense n x n on [CLS]
    return s.encoder_layers * encoder_layer(s, attn) + pooler


def top_path(s: Shape, attn: bool = True) -> float:
    """One path through the top k layers with adapters and the LM head."""
    return s.top_k * (decoder_layer(s, attn) + adapter(s)) + head(s)


def full_decoder_path(s: Shape, attn: bool = True) -> float:
    return s.decoder_layers * decoder_layer(s, attn) + s.top_k * adapter(s) + head(s)


def prefix(s: Shape, attn: bool = True) -> float:
    """Encoder + the frozen decoder layers below the adapters (computed once per example)."""
    return encoder(s, attn) + (s.decoder_layers - s.top_k) * decoder_layer(s, attn)


def backward(s: Shape, attn: bool = True) -> float:
    n, f, S, T, m = s.hidden, s.ffn, s.source_length, s.target_length, s.bottleneck
    # dX of the projections and the FFN; self-attention products 2x, cross-attention products 1x (see top)
    upper_layer = T * (12 * n * n + 4 * n * f) + attn * (8 * T * T * n + 4 * T * S * n)
    adapters = 2 * s.top_k * adapter(s) - 2 * T * n * m  # dW and dX everywhere but dX of the lowest W_down
    return head(s) + (s.top_k - 1) * upper_layer + adapters


def step_flops(s: Shape, attn: bool = True) -> dict[str, dict[str, float]]:
    """Per-example matmul FLOPs of each variant: forward, backward and total."""
    bwd = backward(s, attn)
    forwards = {
        "naive": 2 * (encoder(s, attn) + full_decoder_path(s, attn)),
        "shared_encoder": encoder(s, attn) + 2 * full_decoder_path(s, attn),
        "prefix_cached": 2 * top_path(s, attn),
    }
    return {k: {"forward": f, "backward": bwd, "total": f + bwd} for k, f in forwards.items()}


def breakdown(s: Shape) -> dict[str, float]:
    """Per-example forward FLOPs of the pieces, for the report."""
    return {
        "encoder": encoder(s),
        "decoder_layer": decoder_layer(s),
        "of_which_cross_kv": cross_kv(s),
        "adapter": adapter(s),
        "lm_head": head(s),
        "prefix": prefix(s),
        "top_path": top_path(s),
        "backward": backward(s),
    }
