"""The paper presets' shapes on a GPU (issue 54, item 3): one client's training throughput and peak memory at the
presets' batch of 16, in float32 and under bfloat16 autocast, and beam-4 decoding throughput.

    python3 -m benchmarks.gpu_presets --out "$OUT"            # on a lent GPU machine (no weights, no data)
    python -m benchmarks.gpu_presets --report DIR              # here: reports/bench/gpu.md section 2

BART-base, BART-large and LED-large (``configs/paper-*.yaml``: their adapted layers k, bottleneck m and source
length) are built from their published architecture numbers with random weights (no hub here): speed and memory
depend on the shapes, not the values. Each example is full length (source = the preset's ``max_source_length``, no
padding) with a 100-token target, the paper's batch of 16. For each preset and precision:

- ``prefix``: the frozen prefix of a batch (encoder + the decoder layers below the adapters, once per example and
  run: what the first round pays, ``AdapterSummarizer.compute_prefix``);
- ``step``: one training step of the two-path arm from that prefix held on the device: both paths' top k layers and
  LM head, the selective-KD loss (``distillation_loss``, KD on every token: the worst case of the gate), backward,
  AdamW on the local adapter, as ``benchmarks/train_step.py``'s ``prefix_cached`` step;
- ``decode``: beam 4 of 16 examples, every sequence forced to 100 new tokens (random weights would stop at a random
  EOS); a batch that does not fit is halved until it does, and the batch used is recorded;
- peak GPU memory of the training (prefix + step) and of decoding, ``torch.cuda.max_memory_allocated``.

The median of 3 timed repeats after a warm-up. ``--tiny`` runs the same code on this CPU at toy sizes (a test).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BATCH = 16
TARGET = 100
# facebook/bart-base, facebook/bart-large, allenai/led-large-16384 (their config.json)
ARCH = {
    "paper-bart-base": dict(arch="bart", hidden=768, ffn=3072, heads=12, encoder_layers=6, decoder_layers=6),
    "paper-bart-large": dict(arch="bart", hidden=1024, ffn=4096, heads=16, encoder_layers=12, decoder_layers=12),
    "paper-led-large": dict(arch="led", hidden=1024, ffn=4096, heads=16, encoder_layers=12, decoder_layers=12),
}
VOCAB = 50265
LED_WINDOW = 1024  # led-large-16384's attention_window


def preset_model(name: str, tiny: bool = False) -> dict[str, Any]:
    import yaml

    model = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())["model"]
    shape = ARCH[name] | {
        "top_k": model["top_k"],
        "bottleneck": model["bottleneck"],
        "source_length": model["max_source_length"],
        "vocab": VOCAB,
        "batch": BATCH,
        "target_length": TARGET,
    }
    if tiny:  # the same code at toy sizes
        shape |= dict(hidden=32, ffn=64, heads=2, encoder_layers=2, decoder_layers=2, top_k=1, bottleneck=16)
        shape |= dict(source_length=64, vocab=30522, batch=2, target_length=6)  # vocab: the tokenizer's rows
    return shape


def build(shape: dict[str, Any], device: str, tokenizer):
    """A random-weight backbone of ``shape`` with the summarizer's adapters, built on ``device``."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration, LEDConfig, LEDForConditionalGeneration

    from pipeline.modeling.adapters import AdapterConfig
    from pipeline.modeling.model import AdapterSummarizer

    common = dict(
        vocab_size=shape["vocab"],
        d_model=shape["hidden"],
        encoder_layers=shape["encoder_layers"],
        decoder_layers=shape["decoder_layers"],
        encoder_attention_heads=shape["heads"],
        decoder_attention_heads=shape["heads"],
        encoder_ffn_dim=shape["ffn"],
        decoder_ffn_dim=shape["ffn"],
    )
    torch.manual_seed(0)
    with torch.device(device):
        if shape["arch"] == "led":
            window = min(LED_WINDOW, shape["source_length"] // 2)
            config = LEDConfig(
                **common,
                max_encoder_position_embeddings=max(16384, shape["source_length"]),
                max_decoder_position_embeddings=1024,
                attention_window=[window] * shape["encoder_layers"],
            )
            backbone = LEDForConditionalGeneration(config).eval()
        else:
            config = BartConfig(**common, max_position_embeddings=max(1024, shape["source_length"]))
            backbone = BartForConditionalGeneration(config).eval()
    adapter = AdapterConfig(top_k=shape["top_k"], bottleneck=shape["bottleneck"], seed=0)
    return AdapterSummarizer(backbone, tokenizer, adapter, device=device)


def _timed(fn, repeats: int = 3) -> float:
    import torch

    def once() -> float:
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t

    once()  # warm-up
    return statistics.median(once() for _ in range(repeats))


def _peak_reset() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


def measure_preset(model, shape: dict[str, Any], precision: str, repeats: int) -> dict[str, Any]:
    import torch

    from benchmarks.common import random_batch
    from pipeline.modeling.losses import KDConfig, distillation_loss

    device = model.device.type
    autocast = (
        torch.autocast(device, dtype=torch.bfloat16) if precision == "bfloat16" else nullcontext()
    )  # float32: the matmuls in true float32 (TF32 off, torch's default)
    bench_shape = _Shape(shape)
    cpu_batch = random_batch(bench_shape, model)
    batch = type(cpu_batch)(
        cpu_batch.example_ids, *(t.to(model.device) for t in vars(cpu_batch).values() if hasattr(t, "to"))
    )
    params = model.local_parameters()
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=2e-4, weight_decay=0.01)
    kd = KDConfig(mode="kd")
    n = shape["batch"]
    out: dict[str, Any] = {"precision": precision, "batch": n, "source_length": shape["source_length"]}
    _peak_reset()
    with autocast:
        prefix_s = _timed(lambda: model.compute_prefix(batch), repeats)
        prefix = model.compute_prefix(batch)

        def step() -> None:
            logits_local, logits_global = model.forward_two_paths(batch, prefix)
            distillation_loss(logits_local, logits_global, batch.labels, kd).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        model.train(True)
        step_s = _timed(step, repeats)
        model.train(False)
    out |= {
        "prefix_s": round(prefix_s, 4),
        "step_s": round(step_s, 4),
        "train_examples_per_s_first_round": round(n / (prefix_s + step_s), 1),
        "train_examples_per_s_prefix_held": round(n / step_s, 1),
        "train_peak_gib": _peak_gib(),
    }
    return out | _decode(model, batch, autocast, shape["target_length"])


def _decode(model, batch, autocast, target: int) -> dict[str, Any]:
    """Beam 4 of the batch's examples, halving the batch until it fits the device."""
    import torch

    out: dict[str, Any] = {}
    gen = dict(num_beams=4, max_new_tokens=target, min_new_tokens=target, no_repeat_ngram_size=0, do_sample=False)
    n = len(batch)
    while n >= 1:
        _peak_reset()
        ids, mask = batch.input_ids[:n], batch.attention_mask[:n]
        try:
            with autocast, torch.inference_mode():
                decode_s = _timed(lambda ids=ids, mask=mask: model.generate(ids, mask, path="local", **gen), 1)
        except torch.cuda.OutOfMemoryError:
            out.setdefault("decode_out_of_memory_at", []).append(n)
            n //= 2
            continue
        return out | {
            "decode_batch": n,
            "decode_s": round(decode_s, 3),
            "decode_examples_per_s": round(n / decode_s, 2),
            "decode_peak_gib": _peak_gib(),
        }
    return out


class _Shape:
    """What ``benchmarks.common.random_batch`` reads of a shape."""

    def __init__(self, shape: dict[str, Any]):
        self.batch_size, self.source_length, self.target_length = (
            shape["batch"],
            shape["source_length"],
            shape["target_length"],
        )
        self.vocab, self.arch = shape["vocab"], shape["arch"]


def run(out: Path, tiny: bool, tokenizer_dir: str | None, repeats: int = 3) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from pipeline.modeling.warmup import minilm_dir

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the summarizer checks the vocabulary against a tokenizer; the batches are random ids (MiniLM's 30522 rows)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or minilm_dir())
    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "presets": {},
    }
    out.mkdir(parents=True, exist_ok=True)
    for name in ARCH:
        shape = preset_model(name, tiny)
        t = time.perf_counter()
        model = build(shape, device, tokenizer)
        entry: dict[str, Any] = {"shape": shape, "build_s": round(time.perf_counter() - t, 1), "runs": []}
        record["presets"][name] = entry
        for precision in ("float32", "bfloat16"):
            try:
                entry["runs"].append(measure_preset(model, shape, precision, 1 if tiny else repeats))
            except torch.cuda.OutOfMemoryError as e:
                entry["runs"].append({"precision": precision, "error": f"out of memory: {str(e)[:200]}"})
            (out / "presets.json").write_text(json.dumps(record, indent=1) + "\n")
            print(f"{name} {precision}: {entry['runs'][-1]}", flush=True)
        del model
        _peak_reset()
    return record


def markdown(record: dict[str, Any]) -> str:
    first = next(iter(record["presets"].values()))["shape"]
    lines = [
        "## 2. The paper presets' shapes (`python -m benchmarks.gpu_presets`)",
        "",
        f"Device: {record['device']} (torch {record['torch']}). Random weights in each preset's architecture "
        f"(configs/paper-*.yaml: k, m, source length), batch {first['batch']}, full-length sources, "
        f"{first['target_length']}-token targets. Training: the two-path arm's step (both paths' top k layers and LM head, the KD loss on every "
        "token, backward, AdamW) from a prefix held on the device; the first round also computes the prefix. "
        f"Decoding: beam 4, {first['target_length']} new tokens forced. bfloat16 = `torch.autocast`; float32 without TF32.",
        "",
        "| preset | k / m | source | precision | prefix s | step s | train ex/s (first round / prefix held) | "
        "train peak GiB | decode batch | decode ex/s | decode peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in record["presets"].items():
        s = entry["shape"]
        for r in entry["runs"]:
            head = f"| {name} | {s['top_k']} / {s['bottleneck']} | {s['source_length']} | {r['precision']} |"
            if "error" in r:
                lines.append(f"{head} {r['error'][:60]} | | | | | | |")
                continue
            lines.append(
                f"{head} {r['prefix_s']} | {r['step_s']} | {r['train_examples_per_s_first_round']} / "
                f"{r['train_examples_per_s_prefix_held']} | {r['train_peak_gib']} | {r.get('decode_batch', '-')} | "
                f"{r.get('decode_examples_per_s', '-')} | {r.get('decode_peak_gib', '-')} |"
            )
    return "\n".join(lines) + "\n"


def report(src: Path, md: Path) -> None:
    """Rewrite ``md``'s section 2 from a returned presets.json; the other sections stay."""
    from benchmarks.gpu_profile import replace_section

    section = markdown(json.loads((src / "presets.json").read_text()))
    replace_section(md, 2, section, "fedmeet on a lent GPU (issue 54)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--tokenizer", default=None, help="a folder with MiniLM's tokenizer files (default: the package)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on this CPU (a check of the code)")
    ap.add_argument("--report", type=Path, default=None, help="write reports/bench/gpu.md section 2 from DIR")
    args = ap.parse_args(argv)
    if args.report:
        report(args.report, REPO / "reports" / "bench" / "gpu.md")
        return 0
    run(args.out, args.tiny, args.tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
