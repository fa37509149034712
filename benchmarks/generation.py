"""Generation throughput: tokens per second of greedy and beam search through ``AdapterSummarizer.generate``
(HF ``generate`` with the KV cache; the encoder runs once per call, which is counted with a forward hook).

Every sequence is forced to the same length (``min_new_tokens = max_new_tokens``): random weights would otherwise
stop at a random EOS and the token count would measure luck. Tokens/s counts the tokens of the returned
sequences (batch x new tokens); for beam search ``hypothesis_tokens_per_second`` also counts every beam.
"""

from __future__ import annotations

import torch

from benchmarks.common import Shape, build_summarizer, random_batch, time_interleaved

MODES = {"greedy": {"num_beams": 1}, "beam4": {"num_beams": 4}}


def bench_generation(shape: Shape, n_examples: int, new_tokens: int, repeats: int) -> dict:
    model = build_summarizer(shape)
    batch = random_batch(shape, model, n=n_examples)
    encoder = model.backbone.get_encoder()
    calls = {"n": 0}
    handle = encoder.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))

    lengths = {}

    def run(mode: str):
        def fn() -> None:
            out = model.generate(
                batch.input_ids,
                batch.attention_mask,
                path="local",
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                no_repeat_ngram_size=0,
                **MODES[mode],
            )
            lengths[mode] = int(out.shape[1])

        return fn

    try:
        with torch.inference_mode():
            timings = time_interleaved({mode: run(mode) for mode in MODES}, repeats, warmup=1)
    finally:
        handle.remove()
    calls_per_generate = calls["n"] / ((repeats + 1) * len(MODES))
    out = {
        "shape": shape,
        "n_examples": n_examples,
        "source_length": shape.source_length,
        "new_tokens": new_tokens,
        "encoder_calls_per_generate": calls_per_generate,
        "modes": {},
    }
    for mode, t in timings.items():
        tokens = n_examples * new_tokens
        beams = MODES[mode]["num_beams"]
        out["modes"][mode] = {
            "num_beams": beams,
            "seconds": t.median_s,
            "timing": t,
            "output_length": lengths[mode],
            "tokens_per_second": round(tokens / t.median_s, 2),
            "hypothesis_tokens_per_second": round(tokens * beams / t.median_s, 2),
            "seconds_per_example": round(t.median_s / n_examples, 4),
        }
    return out
