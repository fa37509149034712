"""Seconds per training step of the three ways to get both paths' logits (issue #7, item 3).

- naive: two full HF forwards, the global path under no_grad and the local path with gradients;
- shared_encoder: the encoder once, the full decoder twice;
- prefix_cached: fedmeet's path, the frozen prefix read from ``PrefixCache`` (hits), then the top k layers and the
  LM head once per path (``AdapterSummarizer.forward_two_paths``).
Each step = forward(s) + ``distillation_loss`` + backward + AdamW step on the local adapter, like
``pipeline.training.client_training.train_local``. The loss runs KD on every token (``mode="kd"``): the worst case of
selective KD, chosen because a random-weight teacher is near-uniform (entropy ~ log V > tau), so the entropy gate
would skip the KL term that real training pays for on confident tokens.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from benchmarks import flops
from benchmarks.common import Shape, build_summarizer, random_batch, time_interleaved
from pipeline.experiments.model import ModelConfig
from pipeline.modeling.batching import Batch
from pipeline.modeling.cache import PrefixCache
from pipeline.modeling.losses import KDConfig, distillation_loss
from pipeline.modeling.model import AdapterSummarizer

VARIANTS = ("naive", "shared_encoder", "prefix_cached")
KD = KDConfig(mode="kd")


def make_steps(model: AdapterSummarizer, batch: Batch, cache: PrefixCache) -> dict[str, Callable[[], None]]:
    """One closure per variant, each running a full training step on ``batch``."""
    params = model.local_parameters()
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=2e-4, weight_decay=0.01)
    model.train(True)
    dev = model.device
    input_ids, attention_mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)
    decoder_input_ids, labels = batch.decoder_input_ids.to(dev), batch.labels.to(dev)

    def finish(logits_local: torch.Tensor, logits_global: torch.Tensor) -> None:
        distillation_loss(logits_local, logits_global, labels, KD).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def naive() -> None:
        with torch.no_grad():
            logits_global = model.forward_path(batch, "global")
        finish(model.forward_path(batch, "local"), logits_global)

    def decode(encoder_outputs, path: str) -> torch.Tensor:
        with model.use_path(path):
            return model.backbone(
                encoder_outputs=encoder_outputs,
                attention_mask=attention_mask,
                decoder_input_ids=decoder_input_ids,
                use_cache=False,
            ).logits

    def shared_encoder() -> None:
        with torch.no_grad():
            encoder_outputs = model.backbone.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
            logits_global = decode(encoder_outputs, "global")
        finish(decode(encoder_outputs, "local"), logits_global)

    def prefix_cached() -> None:
        finish(*model.forward_two_paths(batch, cache.prefix_for(model, batch)))

    return {"naive": naive, "shared_encoder": shared_encoder, "prefix_cached": prefix_cached}


def prefix_cost(model: AdapterSummarizer, batch: Batch, repeats: int) -> dict:
    """Seconds to compute the prefix of a batch (one backbone pass up to the first adapted layer) and to compute
    and store it in a cold PrefixCache (what the first use of an example pays)."""
    compute, cold = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.compute_prefix(batch)
        compute.append(time.perf_counter() - t0)
        with tempfile.TemporaryDirectory(prefix="fedmeet-bench-cache-") as tmp:
            shape = {"max_source_length": batch.input_ids.shape[1], "max_target_length": batch.labels.shape[1]}
            cache = PrefixCache(tmp, "bench", ModelConfig(top_k=model.adapter_config.top_k, **shape))
            t0 = time.perf_counter()
            cache.prefix_for(model, batch)
            cold.append(time.perf_counter() - t0)
            entry_bytes = cache.size_bytes / len(batch)
    b = len(batch)
    return {
        "compute_s_per_example": round(statistics.median(compute) / b, 5),
        "compute_and_store_s_per_example": round(statistics.median(cold) / b, 5),
        "cache_bytes_per_example": int(entry_bytes),
    }


def bench_shape(shape: Shape, repeats: int, peak_gflops: float, uses: dict[str, int]) -> dict:
    """Time the three variants on ``shape`` (interleaved, after a warm-up) and set them against the FLOP model."""
    model = build_summarizer(shape)
    batch = random_batch(shape, model)
    with tempfile.TemporaryDirectory(prefix="fedmeet-bench-cache-") as tmp:
        cache = PrefixCache(tmp, f"bench:{shape.name}", shape.model_config)
        cache.prefix_for(model, batch)  # fill: the timed steps read the prefix like any later epoch/round does
        steps = make_steps(model, batch, cache)
        timings = time_interleaved(steps, repeats, warmup=1)
        if cache.stats["misses"] != len(batch):
            raise RuntimeError(f"prefix cache missed during timing: {cache.stats}")
    cost = prefix_cost(model, batch, max(1, repeats // 2))

    b = shape.batch_size
    fl = flops.step_flops(shape)
    variants = {}
    for name in VARIANTS:
        t = timings[name]
        per_example = t.median_s / b
        bound = fl[name]["total"] / (peak_gflops * 1e9)  # seconds per example at the matmul peak
        variants[name] = {
            "seconds_per_step": t.median_s,
            "seconds_per_example": round(per_example, 5),
            "timing": t,
            "gflop_per_example": round(fl[name]["total"] / 1e9, 3),
            "gflop_forward_per_example": round(fl[name]["forward"] / 1e9, 3),
            "gflop_backward_per_example": round(fl[name]["backward"] / 1e9, 3),
            "flop_bound_seconds_per_example": round(bound, 5),
            "measured_over_bound": round(per_example / bound, 3),
            "achieved_gflops": round(fl[name]["total"] / per_example / 1e9, 2),
        }
    cached = variants["prefix_cached"]["seconds_per_example"]
    speedup = {
        "naive_over_prefix_cached": round(variants["naive"]["seconds_per_example"] / cached, 3),
        "shared_encoder_over_prefix_cached": round(variants["shared_encoder"]["seconds_per_example"] / cached, 3),
        "naive_over_shared_encoder": round(
            variants["naive"]["seconds_per_example"] / variants["shared_encoder"]["seconds_per_example"], 3
        ),
        "flops_naive_over_prefix_cached": round(fl["naive"]["total"] / fl["prefix_cached"]["total"], 3),
    }
    amortised = {
        label: {
            "uses": n,
            "seconds_per_example_step": round(cached + cost["compute_and_store_s_per_example"] / n, 5),
            "speedup_over_naive": round(
                variants["naive"]["seconds_per_example"] / (cached + cost["compute_and_store_s_per_example"] / n), 3
            ),
        }
        for label, n in uses.items()
    }
    return {
        "shape": shape,
        "batch_size": b,
        "variants": variants,
        "speedup": speedup,
        "flops_breakdown_gflop_per_example": {k: round(v / 1e9, 4) for k, v in flops.breakdown(shape).items()},
        "prefix": {**cost, "gflop_per_example": round(flops.prefix(shape) / 1e9, 3), "amortised": amortised},
    }
