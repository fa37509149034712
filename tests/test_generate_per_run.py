"""Beam search for several runs in one ``generate`` call (pipeline.results.evaluation.generate_per_run): each run's
adapters stacked on run-major copies of the batch give, run by run, the summaries its adapter gives alone (tiny
BART and tiny BERT2BERT, beam 3, a short last batch), and as the model's own adapter set gives them."""

from __future__ import annotations

import pytest
import torch

from pipeline.modeling.adapters import AdapterConfig
from pipeline.modeling.model import AdapterSummarizer
from pipeline.results.evaluation import EvaluateConfig, generate_per_run
from tests.tiny_models import WORDS, tiny


@pytest.mark.parametrize("kind", ["bart", "bert2bert"])
def test_runs_generated_together_are_each_as_generated_alone(kind):
    backbone, tokenizer = tiny(kind)
    model = AdapterSummarizer(backbone, tokenizer, AdapterConfig(top_k=2, bottleneck=8, seed=0), "cpu")
    start = model.adapter_state("local")
    states = []
    for r in range(3):  # W_up away from zero, a different adapter per run
        generator = torch.Generator().manual_seed(r)
        states.append({k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in start.items()})
    cfg = EvaluateConfig(batch_size=2, num_beams=3, max_target_length=8, min_target_length=2)
    sources = WORDS  # 5 sources: batches of 2, 2 and 1
    together = generate_per_run(model, states, [sources] * 3, cfg, 32, "together")
    alone = []
    for state in states:
        alone.append(generate_per_run(model, [state], [sources], cfg, 32, "alone")[0])
    assert together == alone
    # runs with sources of their own and of other counts (a short last batch filled, a run ending early)
    own = [WORDS[:3], WORDS[1:], WORDS[4:]]
    mixed = generate_per_run(model, states, own, cfg, 32, "mixed")
    for r, state in enumerate(states):
        assert mixed[r] == generate_per_run(model, [state], [own[r]], cfg, 32, "alone")[0], r
    # and as the model's own adapter set generates (HF generate with path "local", not a stack)
    model.load_adapter_state("local", states[-1])
    enc = tokenizer(sources, max_length=32, truncation=True, padding=True, return_tensors="pt")
    own = model.generate(enc["input_ids"], enc["attention_mask"], "local", **cfg.generation_kwargs())
    assert [t.strip() for t in tokenizer.batch_decode(own, skip_special_tokens=True)] == together[-1]
    assert len({tuple(summaries) for summaries in alone}) == 3  # the runs' adapters do summarise differently


@pytest.mark.parametrize("key", ["max_source_length", "max_target_length"])
def test_decoding_lengths_beyond_the_backbones_positions_are_one_config_error(key):
    """evaluate.max_source_length (source truncation) or evaluate.max_target_length (new tokens) beyond the tiny
    BERT2BERT's 512 positions (tiny_models: max_position_embeddings=512 for encoder and decoder) is a ConfigError
    naming the key, the value and the limit, not torch's 'expanded size of the tensor (600) must match (512)'."""
    from pipeline.common.config import ConfigError

    backbone, tokenizer = tiny("bert2bert")
    model = AdapterSummarizer(backbone, tokenizer, AdapterConfig(top_k=2, bottleneck=8, seed=0), "cpu")
    lengths = {"max_source_length": 512, "max_target_length": 4} | {key: 600}
    cfg = EvaluateConfig(batch_size=1, max_target_length=lengths["max_target_length"], min_target_length=1)
    with pytest.raises(ConfigError, match=rf"^evaluate\.{key}=600 is out of range; allowed: <= 512 "):
        generate_per_run(
            model, [model.adapter_state("local")], [[" ".join(WORDS * 200)]], cfg, lengths["max_source_length"], "x"
        )


def test_each_generate_call_holds_runs_of_one_batch_length_so_no_row_is_padding(monkeypatch):
    """Runs of 5, 7 and 13 sources in batches of 4 (as the GPU study's clients of 49, 66 and 129 in batches of 64)
    generate each source once: 25 rows for the three runs, where calls of the runs in their order, a short batch
    filled to its call's widest, would compute 27; a call holds at most GENERATE_ROWS rows (8 here)."""
    from pipeline.results import evaluation

    backbone, tokenizer = tiny("bart")
    model = AdapterSummarizer(backbone, tokenizer, AdapterConfig(top_k=2, bottleneck=8, seed=0), "cpu")
    calls: list[int] = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda ids, *a, **k: calls.append(len(ids)) or generate(ids, *a, **k))
    monkeypatch.setattr(evaluation, "GENERATE_ROWS", 8)
    sources = [(WORDS * 3)[:n] for n in (5, 7, 13)]
    state = model.adapter_state("local")
    cfg = EvaluateConfig(batch_size=4, num_beams=1, max_target_length=4, min_target_length=1)
    summaries = generate_per_run(model, [state] * 3, sources, cfg, 32, "rows")
    assert [len(s) for s in summaries] == [5, 7, 13]
    # sources 0-3: three runs of 4 (two a call, then one); 4-7: batches of 4, 3 and 1, a call each, the longest first;
    # 8-11 and 12: the last run's alone
    assert calls == [8, 4, 4, 3, 1, 4, 1]
    assert summaries == [generate_per_run(model, [state], [s], cfg, 32, "alone")[0] for s in sources]


def test_every_decoding_setting_reaches_generate_as_metrics_json_records_it(monkeypatch):
    """The decoding settings metrics.json records (evaluate params) are the ones beam search runs with: each one
    reaches HF ``generate`` under its HF name (the comparisons above hold whatever the settings are)."""
    backbone, tokenizer = tiny("bart")
    model = AdapterSummarizer(backbone, tokenizer, AdapterConfig(top_k=2, bottleneck=8, seed=0), "cpu")
    seen = []
    real = backbone.generate
    monkeypatch.setattr(backbone, "generate", lambda **kw: seen.append(kw) or real(**kw))
    cfg = EvaluateConfig(
        batch_size=2, num_beams=3, max_target_length=9, min_target_length=4, no_repeat_ngram_size=2, length_penalty=0.7
    )
    generate_per_run(model, [model.adapter_state("local")], [WORDS[:2]], cfg, 32, "settings")
    [kw] = seen
    expected = dict(num_beams=3, max_new_tokens=9, min_new_tokens=4, no_repeat_ngram_size=2, length_penalty=0.7)
    assert {k: kw.get(k) for k in expected} == expected and kw["do_sample"] is False
