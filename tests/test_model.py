"""AdapterSummarizer on tiny BART and tiny BERT2BERT: freezing, two-path equivalence, generation, adapter I/O."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from tiny_models import save_tiny, tiny

from pipeline.experiments.model import ModelConfig
from pipeline.modeling.adapters import AdapterConfig, HoulsbyAdapter
from pipeline.modeling.batching import IGNORE_INDEX, collate, make_batches, tokenize_pairs
from pipeline.modeling.model import AdapterSummarizer

SOURCES = [
    "What did the group decide about the case? #SEP# Industrial Designer: The case could be made of rubber.",
    "Summarize the budget #SEP# Project Manager: Okay, let us start the meeting about the budget and the price.",
    "short #SEP# A: hi",
]
TARGETS = ["They chose a rubber case.", "The manager opened the budget discussion and talked about the price.", "ok"]
IDS = ["0", "1", "2"]
FRAME = pd.DataFrame({"example_id": IDS, "source": SOURCES, "target": TARGETS})
LENGTHS = ModelConfig(max_source_length=64, max_target_length=32)
KINDS = ["bart", "bert2bert"]


def _perturb(model: AdapterSummarizer, path: str, seed: int, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.adapter_sets[path].parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture(scope="module", params=KINDS)
def summarizer(request):
    backbone, tok = tiny(request.param)
    model = AdapterSummarizer(backbone, tok, AdapterConfig(top_k=2, bottleneck=16), device="cpu")
    _perturb(model, "local", 1)
    _perturb(model, "global", 2)
    return model


@pytest.fixture(scope="module")
def batch(summarizer):
    ex = tokenize_pairs(
        summarizer.tokenizer, FRAME.assign(example_id=["a", "b", "c"]), LENGTHS, summarizer.decoder_start_token_id
    )
    return collate(ex, summarizer.pad_token_id, summarizer.decoder_start_token_id)


def test_batch_layout(summarizer, batch):
    valid = batch.labels != IGNORE_INDEX
    lengths = valid.sum(1).tolist()
    assert len(set(lengths)) == 3 and len(set(batch.attention_mask.sum(1).tolist())) == 3  # padded, all different
    for i, n in enumerate(lengths):
        assert batch.decoder_input_ids[i, 0] == summarizer.decoder_start_token_id
        assert torch.equal(batch.decoder_input_ids[i, 1:n], batch.labels[i, : n - 1])  # shifted right
        assert (batch.labels[i, n:] == IGNORE_INDEX).all() and (
            batch.decoder_input_ids[i, n:] == summarizer.pad_token_id
        ).all()
    if summarizer.is_bert2bert:  # decoding starts from [CLS]; it is never a label
        assert (batch.labels[valid] != summarizer.decoder_start_token_id).all()


def test_only_local_adapters_are_trainable(summarizer):
    trainable = {id(p) for p in summarizer.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in summarizer.local_parameters()}
    assert not any(p.requires_grad for p in summarizer.backbone.parameters())


def test_two_path_forward_equals_two_full_forwards(summarizer, batch):
    logits_local, logits_global = summarizer.forward_two_paths(batch)
    valid = batch.labels != IGNORE_INDEX
    ref_local = summarizer.forward_path(batch, "local")
    with torch.no_grad():
        ref_global = summarizer.forward_path(batch, "global")
    torch.testing.assert_close(logits_local[valid], ref_local[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits_global[valid], ref_global[valid], atol=1e-5, rtol=0)
    assert logits_local.requires_grad and not logits_global.requires_grad
    # the two paths really differ, so the comparison above can fail
    assert (logits_local - logits_global)[valid].abs().max() > 1e-2


def test_training_step_changes_only_local_adapters(summarizer, batch):
    from pipeline.modeling.losses import KDConfig, distillation_loss

    backbone_before = {k: v.clone() for k, v in summarizer.backbone.state_dict().items()}
    global_before = summarizer.adapter_state("global")
    local_before = summarizer.adapter_state("local")
    opt = torch.optim.AdamW(summarizer.local_parameters(), lr=1e-2)
    logits_local, logits_global = summarizer.forward_two_paths(batch)
    loss = distillation_loss(logits_local, logits_global, batch.labels, KDConfig(mode="kd")).loss
    loss.backward()
    assert all(p.grad is not None for p in summarizer.local_parameters())
    assert all(p.grad is None for n, p in summarizer.named_parameters() if not n.startswith("adapter_sets.local"))
    opt.step()
    opt.zero_grad()
    for k, v in summarizer.backbone.state_dict().items():
        assert torch.equal(v, backbone_before[k]), k
    for k, v in summarizer.adapter_state("global").items():
        assert torch.equal(v, global_before[k]), k
    assert any(not torch.equal(v, local_before[k]) for k, v in summarizer.adapter_state("local").items())
    summarizer.load_adapter_state("local", local_before)  # leave the shared fixture as it was


def test_adapter_state_io(summarizer):
    local, glob = summarizer.adapter_state("local"), summarizer.adapter_state("global")
    assert set(local) == set(glob) and "layer0.down.weight" in local and "layer1.norm.bias" in local
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in local.values())
    n = summarizer.hidden_size
    assert local["layer0.down.weight"].shape == (16, n) and local["layer0.up.weight"].shape == (n, 16)
    summarizer.load_adapter_state("global", local)
    assert all(torch.equal(summarizer.adapter_state("global")[k], v) for k, v in local.items())
    summarizer.load_adapter_state("global", glob)
    assert all(torch.equal(summarizer.adapter_state("global")[k], v) for k, v in glob.items())
    bad = dict(glob)
    bad["layer0.down.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        summarizer.load_adapter_state("global", bad)


def test_houlsby_adapter_equation():
    torch.manual_seed(0)
    a = HoulsbyAdapter(4, 3)
    with torch.no_grad():
        for p in a.parameters():
            p.normal_()
    y = torch.randn(2, 5, 4)
    z = y + torch.relu(y @ a.down.weight.T + a.down.bias) @ a.up.weight.T + a.up.bias
    expected = (z - z.mean(-1, keepdim=True)) / torch.sqrt(z.var(-1, unbiased=False, keepdim=True) + a.norm.eps)
    torch.testing.assert_close(a(y), expected * a.norm.weight + a.norm.bias)


@pytest.mark.parametrize("kind", KINDS)
def test_round0_equals_the_backbone(kind):
    backbone, tok = tiny(kind)
    # give the layers' output LayerNorms pretrained-like gains and biases (a fresh model has 1 and 0, for which
    # renormalising is nearly the identity and the check would be weak)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in backbone.named_parameters():
            if ("final_layer_norm" in name or "output.LayerNorm" in name) and "decoder" in name:
                p.copy_(
                    0.6 + 0.1 * torch.randn(p.shape, generator=g)
                    if name.endswith("weight")
                    else 0.3 * torch.randn(p.shape, generator=g)
                )
    model = AdapterSummarizer(backbone, tok, AdapterConfig(top_k=2, bottleneck=8), device="cpu")
    ex = tokenize_pairs(tok, FRAME, LENGTHS, model.decoder_start_token_id)
    b = collate(ex, model.pad_token_id, model.decoder_start_token_id)
    valid = b.labels != IGNORE_INDEX
    with torch.no_grad():
        base = model.forward_path(b, None)[valid]
        torch.testing.assert_close(model.forward_path(b, "local")[valid], base, atol=1e-5, rtol=0)
        # W_up = 0 is what makes it exact: a nonzero W_up changes the output
        model.adapter_sets["local"][0].up.weight.normal_(0.0, 0.5, generator=g)
        assert (model.forward_path(b, "local")[valid] - base).abs().max() > 1e-3


def test_generate_greedy_follows_the_local_path(summarizer, batch):
    out = summarizer.generate(
        batch.input_ids, batch.attention_mask, "local", max_new_tokens=3, num_beams=1, do_sample=False
    )
    assert out.shape[0] == 3 and out.shape[1] >= 2
    # greedy = step-by-step argmax of the full local forward (independent of HF's generation loop)
    ids = torch.full((3, 1), summarizer.decoder_start_token_id)
    step = collate(tokenize_pairs(summarizer.tokenizer, FRAME, LENGTHS), summarizer.pad_token_id, 0)
    for _ in range(out.shape[1] - 1):
        step.decoder_input_ids = ids
        with torch.no_grad():
            nxt = summarizer.forward_path(step, "local")[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    done = torch.zeros(3, dtype=torch.bool)
    eos = summarizer.backbone.generation_config.eos_token_id
    for t in range(1, out.shape[1]):  # after EOS, HF pads; compare up to each row's end
        assert torch.equal(out[~done, t], ids[~done, t])
        done |= out[:, t] == eos


def test_generate_beam_and_paths_differ(summarizer, batch):
    beam = summarizer.generate(batch.input_ids, batch.attention_mask, "local", max_new_tokens=5, num_beams=3)
    assert beam.shape[0] == 3
    plain = summarizer.generate(batch.input_ids, batch.attention_mask, None, max_new_tokens=5, num_beams=1)
    direct = summarizer.backbone.generate(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, max_new_tokens=5, num_beams=1
    )
    assert torch.equal(plain, direct)  # no path = the untouched backbone


def test_fingerprint_stable_and_sensitive():
    b1, t1 = tiny("bert2bert")
    b2, t2 = tiny("bert2bert")
    cfg = AdapterConfig(top_k=1, bottleneck=4)
    m1 = AdapterSummarizer(b1, t1, cfg, device="cpu")
    m2 = AdapterSummarizer(b2, t2, cfg, device="cpu")
    assert m1.backbone_fingerprint == m2.backbone_fingerprint
    with torch.no_grad():
        b2.encoder.embeddings.word_embeddings.weight[5, 0] += 1e-3
    del m2.backbone_fingerprint  # hashed again
    assert m1.backbone_fingerprint != m2.backbone_fingerprint


def test_adapter_init_is_seeded():
    backbone, tok = tiny("bart")

    def state(seed):
        torch.rand(7)  # consuming the global RNG must not matter
        m = AdapterSummarizer(backbone, tok, AdapterConfig(top_k=1, bottleneck=4, seed=seed), device="cpu")
        return m.adapter_state("local")

    a, b, c = state(0), state(0), state(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layer0.down.weight"], c["layer0.down.weight"])
    assert torch.count_nonzero(a["layer0.up.weight"]) == 0  # W_up = 0: round 0 is the backbone
    m = AdapterSummarizer(backbone, tok, AdapterConfig(top_k=1, bottleneck=4), device="cpu")
    fresh = m.fresh_adapter_state(0)
    assert all(torch.equal(a[k], fresh[k]) for k in a)


@pytest.mark.parametrize("kind", KINDS)
def test_from_pretrained_directory(kind, tmp_path):
    save_tiny(kind, tmp_path / kind)
    model = AdapterSummarizer.from_pretrained(tmp_path / kind, AdapterConfig(top_k=3, bottleneck=8), device="cpu")
    ref, _ = tiny(kind)
    assert model.is_bert2bert == (kind == "bert2bert")
    assert model.first_adapted == (0 if kind == "bert2bert" else 1)  # 3 (BERT2BERT) or 4 (BART) decoder layers, k = 3
    for k, v in ref.state_dict().items():
        assert torch.equal(model.backbone.state_dict()[k], v), k
    with pytest.raises(ValueError, match="top_k"):
        AdapterSummarizer.from_pretrained(tmp_path / kind, AdapterConfig(top_k=9, bottleneck=8), device="cpu")


def test_make_batches_shuffles_deterministically(summarizer):
    df = pd.DataFrame({"example_id": ["a", "b", "c"], "source": SOURCES, "target": TARGETS})
    cfg = ModelConfig(max_source_length=12, max_target_length=6)
    b1 = make_batches(df, summarizer, cfg, 2, True, 7)
    b2 = make_batches(df, summarizer, cfg, 2, True, 7)
    assert [b.example_ids for b in b1] == [b.example_ids for b in b2]
    # shuffled: the rows in numpy.random.default_rng(7)'s permutation (make_batches' docstring), 0, 2, 1
    assert np.random.default_rng(7).permutation(3).tolist() == [0, 2, 1]
    assert [b.example_ids for b in b1] == [["a", "c"], ["b"]]
    assert max(b.input_ids.shape[1] for b in b1) <= 12 and max(b.labels.shape[1] for b in b1) <= 6
    with pytest.raises(KeyError, match="target"):  # the examples file's columns are checked when it is read
        make_batches(df.drop(columns="target"), summarizer, cfg, 2, False, 0)


@pytest.mark.parametrize("kind", ["led", "mbart"])
def test_other_architectures(kind, tmp_path):
    """LED (long input, post-LN) and mBART (pre-LN): two-path = full forwards, generation works; round 0 equals
    the backbone exactly for post-LN LED, approximately for pre-LN mBART (see pipeline/modeling/adapters.py)."""
    save_tiny(kind, tmp_path)
    model = AdapterSummarizer.from_pretrained(tmp_path, AdapterConfig(top_k=2, bottleneck=8), device="cpu")
    assert model.pre_layer_norm == (kind == "mbart")
    b = collate(
        tokenize_pairs(model.tokenizer, FRAME, LENGTHS, model.decoder_start_token_id),
        model.pad_token_id,
        model.decoder_start_token_id,
    )
    valid = b.labels != IGNORE_INDEX
    with torch.no_grad():
        base = model.forward_path(b, None)[valid]
        round0 = model.forward_path(b, "global")[valid]
    assert (round0 - base).abs().max() < (1e-5 if kind == "led" else 0.05)
    _perturb(model, "local", 5)
    logits_local, logits_global = model.forward_two_paths(b)
    torch.testing.assert_close(logits_local[valid], model.forward_path(b, "local")[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits_global[valid], round0, atol=1e-5, rtol=0)
    assert model.generate(b.input_ids, b.attention_mask, "local", max_new_tokens=3, num_beams=2).shape[0] == 3


def test_head_on_real_tokens_only_keeps_loss_and_gradients(summarizer, batch):
    """The LM head runs on non-padding positions only ([B, T, V] with zeros on padding, or packed [N, V]): same
    loss and same local-adapter gradients as the full HF forward on a padded batch."""
    from pipeline.modeling.losses import KDConfig, distillation_loss

    valid = batch.labels != IGNORE_INDEX
    assert not valid.all()  # the batch is padded, so skipping padding matters
    cfg = KDConfig(mode="kd", kd_lambda=0.4)
    params = summarizer.local_parameters()
    trainable_before = [p.requires_grad for p in params]  # restored below: the fixture is shared by later tests
    for p in params:
        p.requires_grad_(True)

    def loss_and_grads(logits_local, logits_global):
        loss = distillation_loss(logits_local, logits_global, batch.labels, cfg).loss
        grads = torch.autograd.grad(loss, params)
        return loss.item(), grads

    try:
        with torch.no_grad():
            ref_global = summarizer.forward_path(batch, "global")
        ref_loss, ref_grads = loss_and_grads(summarizer.forward_path(batch, "local"), ref_global)
        full = summarizer.forward_two_paths(batch)
        packed = summarizer.forward_two_paths(batch, packed=True)
        assert full[0].shape == ref_global.shape and packed[0].shape == (
            int(valid.sum()),
            ref_global.shape[-1],
        )
        assert (full[0][~valid] == 0).all() and (full[1][~valid] == 0).all()
        torch.testing.assert_close(packed[1], full[1][valid], atol=1e-6, rtol=0)
        for logits_local, logits_global in (full, packed):
            loss, grads = loss_and_grads(logits_local, logits_global)
            assert abs(loss - ref_loss) < 1e-5
            for g, r in zip(grads, ref_grads):
                torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
        # path_logits on a prefix from compute_prefix (which carries the target mask) = forward_path on real tokens
        with torch.no_grad():
            prefix = summarizer.compute_prefix(batch)
            local = summarizer.path_logits(prefix, "local", summarizer.top_masks(prefix))
            ref_local = summarizer.forward_path(batch, "local")
        torch.testing.assert_close(local[valid], ref_local[valid], atol=1e-5, rtol=0)
        assert (local[~valid] == 0).all()
    finally:
        for p, trainable in zip(params, trainable_before):
            p.requires_grad_(trainable)


def test_make_batches_bucketing_by_length(summarizer):
    rng = torch.Generator().manual_seed(0)
    n = 40
    lengths = torch.randint(1, 25, (n,), generator=rng).tolist()
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
    df = pd.DataFrame(
        {
            "example_id": [f"x{i}" for i in range(n)],
            "source": [f"query #SEP# A: {words[i % len(words)]}" for i in range(n)],
            "target": [" ".join(words[(i + j) % len(words)] for j in range(k)) for i, k in enumerate(lengths)],
        }
    )
    cfg = ModelConfig(max_source_length=16, max_target_length=32)

    def batches(seed, bucket, shuffle=True, bucket_batches=50):
        return make_batches(
            df,
            summarizer,
            cfg,
            4,
            shuffle,
            seed,
            bucket_by_length=bucket,
            bucket_batches=bucket_batches,
        )

    def padding(bs):
        return sum(int((b.labels == IGNORE_INDEX).sum()) for b in bs)

    plain, bucketed = batches(3, False), batches(3, True)
    assert [b.example_ids for b in batches(3, False)] == [b.example_ids for b in plain]  # default unchanged
    assert [b.example_ids for b in batches(3, True)] == [b.example_ids for b in bucketed]  # seeded
    assert [b.example_ids for b in batches(4, True)] != [b.example_ids for b in bucketed]
    assert sorted(sum((b.example_ids for b in bucketed), [])) == sorted(df["example_id"])  # each example once
    assert padding(bucketed) < padding(plain) / 2
    # one chunk, no shuffle: batches follow ascending target length and never overlap in length
    ordered = batches(0, True, shuffle=False)
    lengths = [(b.labels != IGNORE_INDEX).sum(dim=1) for b in ordered]
    spans = [(int(n.min()), int(n.max())) for n in lengths]
    assert all(hi <= lo_next for (_, hi), (lo_next, _) in zip(spans, spans[1:]))
    # chunks of 2 batches: sorting happens within each chunk of 8 consecutive (shuffled) examples only
    small = batches(5, True, bucket_batches=2)
    perm = [b.example_ids for b in batches(5, False)]
    chunks = [sorted(sum(perm[i : i + 2], [])) for i in range(0, len(perm), 2)]
    assert all(any(set(b.example_ids) <= set(c) for c in chunks) for b in small)


def _builders_masks(model: AdapterSummarizer, prefix):
    """The masks as the HF decoders make them: an all-ones target mask and the source mask, each tested for padding."""
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

    h, config = prefix.decoder_hidden, model._stack.config
    ones = torch.ones(h.shape[:2], dtype=torch.long)
    causal = create_causal_mask(config=config, inputs_embeds=h, past_key_values=None, attention_mask=ones)
    cross = create_bidirectional_mask(
        config=config, inputs_embeds=h, attention_mask=prefix.encoder_mask, encoder_hidden_states=prefix.encoder_hidden
    )
    return causal, cross


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_top_masks_are_the_builders_masks_made_without_reading_the_device(summarizer, batch, attention):
    """top_masks gives the masks the HF builders give (None where they skip one), for a padded and an unpadded
    source, and reads nothing from the device: on the meta device (no values to read) it builds them from the
    host's source mask, while a builder given the device's padding mask reads it (a host sync on a GPU)."""
    config = summarizer._stack.config
    before = config._attn_implementation
    config._attn_implementation = attention
    try:
        full = summarizer.compute_prefix(batch)
        assert not batch.attention_mask.all()  # the fixture's sources are padded
        rows = torch.tensor([i for i in range(len(batch)) if batch.attention_mask[i].all()])  # the longest source
        unpadded = type(full)(*(t[rows] for t in vars(full).values()))
        assert _builders_masks(summarizer, unpadded)[1] is None  # no padding: the builder skips the cross mask
        for prefix, host in ((full, batch.attention_mask), (unpadded, batch.attention_mask[rows])):
            expected = _builders_masks(summarizer, prefix)
            for source_mask in (host, None):
                for mask, want in zip(summarizer.top_masks(prefix, source_mask), expected, strict=True):
                    assert (mask is None) == (want is None)
                    assert mask is None or torch.equal(mask, want)
        meta = type(full)(*(t.to("meta") for t in vars(full).values()))
        self_mask, cross_mask = summarizer.top_masks(meta, batch.attention_mask)
        assert cross_mask is not None and cross_mask.device.type == "meta"
        with pytest.raises((NotImplementedError, RuntimeError)):
            summarizer.top_masks(meta)  # the prefix's own mask: read from the device
        with pytest.raises((NotImplementedError, RuntimeError)):
            _builders_masks(summarizer, meta)
    finally:
        config._attn_implementation = before


def test_led_encodes_with_global_attention_on_the_first_token():
    """HF's LED recipe for summarization: global attention on the first token (global_attention_mask 1 at position
    0) in every forward and in generate; without it each token sees its local window only (8 tokens here). The encoder
    output of the prefix (training, the cache) and of generation must be LED's own with that mask."""
    backbone, tok = tiny("led")
    model = AdapterSummarizer(backbone, tok, AdapterConfig(top_k=2, bottleneck=8), device="cpu")
    b = collate(tokenize_pairs(tok, FRAME, LENGTHS, model.decoder_start_token_id), model.pad_token_id, 2)
    source = {"input_ids": b.input_ids, "attention_mask": b.attention_mask}
    first = torch.zeros_like(b.attention_mask)
    first[:, 0] = 1
    encoder, seen = backbone.get_encoder(), []
    with torch.no_grad():
        local_only = encoder(**source).last_hidden_state
        expected = encoder(**source, global_attention_mask=first).last_hidden_state
    assert b.input_ids.shape[1] > 8 and (expected - local_only).abs().max() > 1e-3  # longer than the window
    torch.testing.assert_close(model.compute_prefix(b).encoder_hidden, expected, atol=1e-6, rtol=0)
    with encoder.register_forward_hook(lambda module, args, out: seen.append(out.last_hidden_state)):
        model.generate(**source, path="local", max_new_tokens=3, num_beams=2)
    torch.testing.assert_close(seen[0], expected, atol=1e-6, rtol=0)
