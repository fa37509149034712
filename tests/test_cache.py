"""Frozen-prefix cache: exactness against the uncached path, keys, eviction."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch
from tiny_models import tiny

from pipeline.experiments.model import ModelConfig
from pipeline.modeling.adapters import AdapterConfig
from pipeline.modeling.batching import IGNORE_INDEX, collate, tokenize_pairs
from pipeline.modeling.cache import PrefixCache
from pipeline.modeling.losses import KDConfig, distillation_loss
from pipeline.modeling.model import AdapterSummarizer

SOURCES = [
    "What was decided? #SEP# Industrial Designer: The case could be made of rubber or plastic, said the designer.",
    "Budget #SEP# Project Manager: Okay, let us start.",
    "short #SEP# A: hi",
    "Why? #SEP# Marketing: Our research shows that young people like fancy colours and simple remotes.",
]
TARGETS = ["They chose a rubber case.", "The manager opened the budget meeting.", "ok", "Young people like colour."]
IDS = ["e0", "e1", "e2", "e3"]
FRAME = pd.DataFrame({"example_id": IDS, "source": SOURCES, "target": TARGETS})
LENGTHS = ModelConfig(max_source_length=64, max_target_length=32)


@pytest.fixture(scope="module", params=["bart", "bert2bert"])
def model(request):
    backbone, tok = tiny(request.param)
    m = AdapterSummarizer(backbone, tok, AdapterConfig(top_k=2, bottleneck=16), device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for path, scale in (("local", 0.3), ("global", 0.2)):
            for p in m.adapter_sets[path].parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return m


def _batch(model, idx):
    ex = tokenize_pairs(
        model.tokenizer,
        FRAME.iloc[idx],
        LENGTHS,
        model.decoder_start_token_id,
    )
    return collate(ex, model.pad_token_id, model.decoder_start_token_id)


def _cache(model, root, **kw):
    """A cache of ``model`` with LENGTHS and top_k 2; ``kw`` replaces its fingerprint, dtype, max_bytes or a model
    setting."""
    settings = {k: kw.pop(k) for k in ("max_source_length", "max_target_length", "top_k") if k in kw}
    args = dict(fingerprint=model.backbone_fingerprint, dtype="float32", max_bytes=10**8) | kw
    return PrefixCache(root, cfg=dataclasses.replace(LENGTHS, **{"top_k": 2} | settings), **args)


def test_cached_prefix_gives_the_uncached_logits_and_loss(model, tmp_path):
    cache = _cache(model, tmp_path)
    cfg = KDConfig(mode="selective", tau=5.0)
    batch = _batch(model, [0, 1, 2])
    valid = batch.labels != IGNORE_INDEX
    ref = model.forward_two_paths(batch)
    ref_loss = distillation_loss(ref[0], ref[1], batch.labels, cfg).loss

    first = model.forward_two_paths(batch, cache.prefix_for(model, batch))
    assert cache.stats["misses"] == 3 and cache.stats["hits"] == 0
    # the same examples again, now in other batches with other padding: all hits
    regrouped = [_batch(model, [2, 3]), _batch(model, [1, 0])]
    outs = [model.forward_two_paths(b, cache.prefix_for(model, b)) for b in regrouped]
    assert cache.stats["hits"] == 3 and cache.stats["misses"] == 4  # e3 was new

    torch.testing.assert_close(first[0][valid], ref[0][valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(first[1][valid], ref[1][valid], atol=1e-5, rtol=0)
    loss = distillation_loss(first[0], first[1], batch.labels, cfg).loss
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    # per example, the regrouped batches give the same logits as the first batch
    for b, out in zip(regrouped, outs):
        for j, eid in enumerate(b.example_ids):
            if eid == "e3":
                continue
            i = batch.example_ids.index(eid)
            n = int((b.labels[j] != IGNORE_INDEX).sum())
            torch.testing.assert_close(out[0][j, :n], ref[0][i, :n], atol=1e-5, rtol=0)
    # gradients flow from the cached path into the local adapters only
    loss.backward()
    assert all(p.grad is not None for p in model.local_parameters())
    model.zero_grad()


def test_key_changes_with_every_component(model, tmp_path):
    base = _cache(model, tmp_path)
    variants = [
        _cache(model, tmp_path, fingerprint="0" * 64),
        _cache(model, tmp_path, max_source_length=65),
        _cache(model, tmp_path, max_target_length=33),
        _cache(model, tmp_path, top_k=1),
        _cache(model, tmp_path, dtype="float16"),
    ]
    keys = {base.key} | {v.key for v in variants}
    assert len(keys) == 6
    assert _cache(model, tmp_path).key == base.key  # and it is stable
    batch = _batch(model, [0, 1])
    base.prefix_for(model, batch)
    other = variants[1]
    other.prefix_for(model, batch)
    assert other.stats["misses"] == 2 and other.stats["hits"] == 0  # recomputed under the new key
    again = _cache(model, tmp_path)
    again.prefix_for(model, batch)
    assert again.stats["hits"] == 2


def test_changed_tokens_never_hit_a_stale_entry(model, tmp_path):
    cache = _cache(model, tmp_path)
    cache.prefix_for(model, _batch(model, [0]))
    ex = tokenize_pairs(
        model.tokenizer,
        FRAME.iloc[:1].assign(source="A different text #SEP# B: yes"),
        LENGTHS,
        model.decoder_start_token_id,
    )
    changed = collate(ex, model.pad_token_id, model.decoder_start_token_id)
    prefix = cache.prefix_for(model, changed)
    assert cache.stats["misses"] == 2
    torch.testing.assert_close(prefix.decoder_hidden, model.compute_prefix(changed).decoder_hidden)
    # the same id and source with an edited summary: the decoder tokens name the entry too (a decoder prefix of the
    # old summary's tokens would be read for the new labels)
    ex = tokenize_pairs(
        model.tokenizer, FRAME.iloc[:1].assign(target="Another summary."), LENGTHS, model.decoder_start_token_id
    )
    edited = collate(ex, model.pad_token_id, model.decoder_start_token_id)
    prefix = cache.prefix_for(model, edited)
    assert cache.stats["misses"] == 3 and cache.stats["hits"] == 0
    torch.testing.assert_close(prefix.decoder_hidden, model.compute_prefix(edited).decoder_hidden)


def test_half_precision_cache_is_close(model, tmp_path):
    cache = _cache(model, tmp_path, dtype="bfloat16")
    batch = _batch(model, [0, 1])
    valid = batch.labels != IGNORE_INDEX
    ref = model.forward_two_paths(batch)[0][valid]
    got = model.forward_two_paths(batch, cache.prefix_for(model, batch))[0][valid]
    assert (got - ref).abs().max() < 0.1


def _same_size_batch(model, eid):
    ex = tokenize_pairs(model.tokenizer, FRAME.iloc[:1].assign(example_id=eid), LENGTHS, model.decoder_start_token_id)
    return collate(ex, model.pad_token_id, model.decoder_start_token_id)


def test_an_entry_written_again_is_counted_once(model, tmp_path):
    """A stacked micro-batch repeats an example (pipeline.training.local_batch: runs sharing examples, rows filled
    with copies of the first): each copy missed and wrote its entry again, and the count added it each time, so the
    cache believed itself fuller than its files and evicted early. The count must be the files' sizes on disk."""
    one = _batch(model, [0, 1])
    probe = _cache(model, tmp_path / "probe")
    probe.prefix_for(model, one)
    for name, room in (("ample", 10**8), ("exact", probe.size_bytes)):  # exact: room for the two entries only
        cache = _cache(model, tmp_path / name, max_bytes=room)
        cache.prefix_for(model, one.select([0, 1, 0, 1]))
        files = list((tmp_path / name).glob("*/*.safetensors"))
        assert len(files) == 2 and cache.size_bytes == sum(p.stat().st_size for p in files) == probe.size_bytes
        assert cache.stats["evicted"] == 0


def test_size_limit_evicts_least_recently_used(model, tmp_path):
    # four entries of identical size (same text, different ids) and room for two of them
    probe = _cache(model, tmp_path / "probe")
    probe.prefix_for(model, _same_size_batch(model, "z"))
    size = probe.size_bytes
    cache = _cache(model, tmp_path / "lru", max_bytes=2 * size + 10)
    for eid in ["z0", "z1", "z2"]:
        cache.prefix_for(model, _same_size_batch(model, eid))
    cache.prefix_for(model, _same_size_batch(model, "z1"))  # z1 is used again: z0 is now the least recent
    cache.prefix_for(model, _same_size_batch(model, "z3"))
    assert cache.stats == {"hits": 1, "misses": 4, "evicted": 2, "refused": 0, "damaged": 0}
    files = list((tmp_path / "lru").glob("*/*.safetensors"))
    assert len(files) == 2 and cache.size_bytes == 2 * size == sum(p.stat().st_size for p in files)
    cache.prefix_for(model, _same_size_batch(model, "z1"))
    cache.prefix_for(model, _same_size_batch(model, "z3"))
    assert cache.stats["hits"] == 3  # z1 and z3 survived; z0 and z2 were evicted
    cache.prefix_for(model, _same_size_batch(model, "z0"))
    assert cache.stats["misses"] == 5
    tiny_budget = _cache(model, tmp_path / "none", max_bytes=100)
    prefix = tiny_budget.prefix_for(model, _batch(model, [0]))  # still returns the prefix, stores nothing
    assert tiny_budget.stats["refused"] == 1 and not list((tmp_path / "none").glob("*/*.safetensors"))
    assert prefix.decoder_hidden.shape[0] == 1


def test_an_entry_gone_between_listing_and_stat_is_skipped_by_the_size_count_and_eviction(model, tmp_path):
    """Processes sharing a cache (DVC's parallel train stages) evict each other's entries: a file another process
    removed after this one listed the directory made p.stat() raise FileNotFoundError in the size count of a new
    cache and in eviction's sort, ending the training. A dangling link is such a file, for as long as it is there."""
    probe = _cache(model, tmp_path / "probe")
    probe.prefix_for(model, _same_size_batch(model, "z"))
    size = probe.size_bytes
    root = tmp_path / "shared"
    first = _cache(model, root, max_bytes=2 * size + 10)
    first.prefix_for(model, _same_size_batch(model, "z0"))
    (first.dir / f"{'0' * 32}.safetensors").symlink_to(first.dir / "evicted-meanwhile")
    cache = _cache(model, root, max_bytes=2 * size + 10)  # another process, starting
    assert cache.size_bytes == size
    for eid in ["z1", "z2"]:  # z2 needs room: z0 is evicted, the vanished entry passed over
        cache.prefix_for(model, _same_size_batch(model, eid))
    assert cache.stats["evicted"] == 1 and cache.size_bytes == 2 * size
    assert sorted(p.name for p in first.dir.glob("*.safetensors") if p.exists()) == sorted(
        cache._paths[k].name for k in cache._paths
    )


@pytest.mark.parametrize("damage", ["truncate", "flip_tensor_byte", "strip_checksum"])
def test_damaged_entry_is_counted_removed_and_recomputed_exactly(model, tmp_path, damage):
    from safetensors.torch import load_file, save_file

    batch = _batch(model, [0])
    cache = _cache(model, tmp_path)
    reference = cache.prefix_for(model, batch)
    (path,) = list(tmp_path.glob("*/*.safetensors"))
    raw = path.read_bytes()
    if damage == "truncate":  # a copy cut short
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip_tensor_byte":  # a bit rot in the tensor data, header intact
        path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    else:  # written by an older fedmeet without a checksum
        save_file(load_file(str(path)), str(path))
    fresh = _cache(model, tmp_path)  # a new process reading the same disk
    again = fresh.prefix_for(model, batch)
    assert fresh.stats["damaged"] == 1 and fresh.stats["misses"] == 1 and fresh.stats["hits"] == 0
    assert torch.equal(again.encoder_hidden, reference.encoder_hidden)
    assert torch.equal(again.decoder_hidden, reference.decoder_hidden)
    # the recomputed entry replaced the damaged one: the next read is a clean hit
    fresh.prefix_for(model, batch)
    assert fresh.stats["hits"] == 1 and fresh.stats["damaged"] == 1


def test_relative_cache_dir_is_shared_by_dvc_temporary_workspaces(tmp_path, monkeypatch):
    """A queued or --temp DVC experiment runs in <repo>/.dvc/tmp/exps/<tmp>/ with DVC_ROOT set there: a relative
    model.cache_dir must still name <repo>/data/cache/prefix, the cache the workspace's runs filled (an absolute one:
    itself)."""
    from types import SimpleNamespace

    from pipeline.experiments.settings import CacheConfig
    from pipeline.training.shared_model import prefix_cache_for

    repo = tmp_path / "repo"
    temp = repo / ".dvc/tmp/exps/tmp8k2j"
    temp.mkdir(parents=True)
    monkeypatch.chdir(temp)
    monkeypatch.delenv("FEDMEET_ROOT", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(temp))
    plan = SimpleNamespace(train=SimpleNamespace(prefix_cache=True), model_config=LENGTHS, cache_dtype=None)
    model = SimpleNamespace(backbone_fingerprint="backbone")
    for cache_dir, root in (("data/cache/prefix", repo.resolve() / "data/cache/prefix"), (tmp_path / "elsewhere",) * 2):
        assert prefix_cache_for(plan, model, CacheConfig(cache_dir=str(cache_dir))).root == root


def test_an_entry_read_once_stays_resident_and_leaves_memory_with_its_disk_file(model, tmp_path):
    batch = _batch(model, [0])
    cache = _cache(model, tmp_path)
    first = cache.prefix_for(model, batch)  # computed, stored, kept
    (path,) = list(tmp_path.glob("*/*.safetensors"))
    path.write_bytes(b"damaged after it was read")
    again = cache.prefix_for(model, batch)  # the resident copy: the disk is not read (nor hashed) again
    assert cache.stats["hits"] == 1 and cache.stats["damaged"] == 0
    assert torch.equal(again.encoder_hidden, first.encoder_hidden)
    assert torch.equal(again.decoder_hidden, first.decoder_hidden)
    fresh = _cache(model, tmp_path)  # another process reads the disk and finds the damage
    fresh.prefix_for(model, batch)
    assert fresh.stats["damaged"] == 1 and fresh.stats["misses"] == 1
    # evicted from disk (another entry needs the room): out of memory too, so the next read computes it again
    size = fresh.size_bytes
    small = _cache(model, tmp_path / "small", max_bytes=size + 10)
    small.prefix_for(model, batch)
    small.prefix_for(model, _batch(model, [2]))
    assert small.stats["evicted"] >= 1 and len(small.resident) == 1
    small.prefix_for(model, batch)
    assert small.stats["misses"] == 3 and small.stats["hits"] == 0


def test_each_pair_is_tokenised_once_per_process(model):
    class Counting:  # the model's tokenizer, counting the texts it is given
        def __init__(self, tokenizer):
            self.tokenizer, self.texts = tokenizer, 0

        def __call__(self, texts=None, **kwargs):
            self.texts += len(texts if texts is not None else kwargs["text_target"])
            return self.tokenizer(texts, **kwargs)

    counting = Counting(model.tokenizer)
    first = tokenize_pairs(counting, FRAME.iloc[:2], LENGTHS, model.decoder_start_token_id)
    assert counting.texts == 4  # two sources, two targets
    again = tokenize_pairs(counting, FRAME.iloc[:3], LENGTHS, model.decoder_start_token_id)
    assert counting.texts == 6  # only the new pair
    direct = tokenize_pairs(model.tokenizer, FRAME.iloc[:3], LENGTHS, model.decoder_start_token_id)
    assert [(e.example_id, e.input_ids, e.labels) for e in again] == [
        (e.example_id, e.input_ids, e.labels) for e in direct
    ]
    assert again[:2] == first
    # an edited text is another pair: tokenised anew, never the stale ids
    edited = tokenize_pairs(counting, FRAME.iloc[:1].assign(source="changed"), LENGTHS, model.decoder_start_token_id)
    assert counting.texts == 8 and edited[0].input_ids != first[0].input_ids
