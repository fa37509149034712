"""Summaries generated with a model's local adapter (beam search), as the evaluate stage and the deployed
clients' federated evaluation produce them."""
from __future__ import annotations


def generate_summaries(model, sources: list[str], cfg, max_source_length: int, desc: str) -> list[str]:
    """Beam-search summaries of ``sources`` with the model's local adapter, in batches of ``cfg.batch_size``
    (``cfg``: pipeline.results.evaluation.EvaluateConfig, whose ``generation_kwargs()`` are passed on)."""
    import torch
    from tqdm import tqdm

    tokenizer = model.tokenizer
    outputs: list[str] = []
    kwargs = cfg.generation_kwargs()
    with torch.no_grad():
        for start in tqdm(range(0, len(sources), cfg.batch_size), desc=desc, unit="batch", leave=False):
            chunk = sources[start:start + cfg.batch_size]
            enc = tokenizer(chunk, max_length=max_source_length, truncation=True, padding=True, return_tensors="pt")
            ids = model.generate(enc["input_ids"], enc["attention_mask"], path="local", **kwargs)
            outputs.extend(t.strip() for t in tokenizer.batch_decode(ids, skip_special_tokens=True))
    return outputs
