"""Tokenisation and collation of examples into model batches.

Targets: ``labels`` are the target's token ids with the tokenizer's special tokens (BART ``<s> ... </s>``, BERT
``... [SEP]``); a leading token equal to the decoder start token is dropped (BERT2BERT starts decoding from
``[CLS]``, so predicting ``[CLS]`` would be a wasted first step). ``decoder_input_ids`` = labels shifted right
with the model's ``decoder_start_token_id``. Labels are padded on the right with -100 (ignored by every loss);
padded decoder inputs hold the pad id. Padding is per batch (to the longest member)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

IGNORE_INDEX = -100
TENSOR_FIELDS = ("input_ids", "attention_mask", "decoder_input_ids", "labels")  # Batch's fields after its ids


@dataclass
class TokenizedExample:
    example_id: str
    input_ids: list[int]
    labels: list[int]


@dataclass
class Batch:
    example_ids: list[str]
    input_ids: torch.Tensor  # [B, S] source ids, right-padded with pad id
    attention_mask: torch.Tensor  # [B, S] 1 on source tokens
    decoder_input_ids: torch.Tensor  # [B, T] labels shifted right, start token first
    labels: torch.Tensor  # [B, T] target ids, IGNORE_INDEX (-100) on padding

    def __len__(self) -> int:
        return len(self.example_ids)

    def select(self, rows: slice | list[int]) -> Batch:
        """The examples at ``rows`` (a slice: views of the tensors; a list of positions: copies, in that order)."""
        ids = self.example_ids[rows] if isinstance(rows, slice) else [self.example_ids[i] for i in rows]
        return Batch(ids, *(getattr(self, f)[rows] for f in TENSOR_FIELDS))

    @cached_property
    def target_tokens(self) -> int:
        """The batch's target tokens (labels that are not IGNORE_INDEX), counted once."""
        return int((self.labels != IGNORE_INDEX).sum())


# Per tokenizer and lengths, each (example id, source, target) tokenised so far in this process: every round
# and validation of a run, and every run of a set, reuses them instead of tokenising the same texts again.
_TOKENIZED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenize_pairs(tokenizer, examples_df, cfg, decoder_start_token_id: int | None = None) -> list[TokenizedExample]:
    """Rows of ``examples_df`` (columns ``example_id, source, target``) tokenised with truncation to ``cfg``'s max
    lengths (special tokens kept) and no padding; each pair once per process (the examples returned are shared: read
    them, do not change them)."""
    lengths = (cfg.max_source_length, cfg.max_target_length)
    done = _TOKENIZED.setdefault(tokenizer, {}).setdefault((*lengths, decoder_start_token_id), {})
    columns = (examples_df[c].tolist() for c in ("example_id", "source", "target"))
    keys = [(str(eid), s, t) for eid, s, t in zip(*columns)]
    if new := [k for k in dict.fromkeys(keys) if k not in done]:
        src = tokenizer([k[1] for k in new], max_length=lengths[0], truncation=True)["input_ids"]
        tgt = tokenizer(text_target=[k[2] for k in new], max_length=lengths[1], truncation=True)["input_ids"]
        for key, s, t in zip(new, src, tgt):
            t = target_labels(t, decoder_start_token_id)
            if not t:
                raise ValueError(f"example {key[0]}: empty target after tokenisation")
            done[key] = TokenizedExample(key[0], list(s), t)
    return [done[k] for k in keys]


def target_labels(ids: Sequence[int], decoder_start_token_id: int | None) -> list[int]:
    """A tokenised target's labels: its ids without a leading decoder start token (see the module docstring)."""
    ids = list(ids)
    return ids[1:] if decoder_start_token_id is not None and len(ids) > 1 and ids[0] == decoder_start_token_id else ids


def collate(examples: Sequence[TokenizedExample], pad_token_id: int, decoder_start_token_id: int) -> Batch:
    """Pad a list of tokenised examples into a Batch (right padding)."""
    b = len(examples)
    s = max(len(e.input_ids) for e in examples)
    t = max(len(e.labels) for e in examples)
    # filled in NumPy (a list assigned to a slice is one C loop; a torch.tensor per row costs ~20 us a call)
    input_ids = np.full((b, s), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((b, s), dtype=np.int64)
    labels = np.full((b, t), IGNORE_INDEX, dtype=np.int64)
    decoder_input_ids = np.full((b, t), pad_token_id, dtype=np.int64)
    for i, e in enumerate(examples):
        input_ids[i, : len(e.input_ids)] = e.input_ids
        attention_mask[i, : len(e.input_ids)] = 1
        labels[i, : len(e.labels)] = e.labels
        decoder_input_ids[i, 0] = decoder_start_token_id
        decoder_input_ids[i, 1 : len(e.labels)] = e.labels[:-1]
    tensors = (torch.from_numpy(a) for a in (input_ids, attention_mask, decoder_input_ids, labels))
    return Batch([e.example_id for e in examples], *tensors)


def stack_batches(batches: Sequence[Batch], pad_token_id: int, rows: int) -> Batch:
    """Batches one after the other as one, each a block of ``rows`` examples (copies of its first appended: the caller
    ignores their labels, so they add no token and no gradient), padded to the longest source and target of all
    (right padding)."""
    s = max(b.input_ids.shape[1] for b in batches)
    t = max(b.labels.shape[1] for b in batches)
    tensors = []
    for name, width, value in zip(TENSOR_FIELDS, (s, s, t, t), (pad_token_id, 0, pad_token_id, IGNORE_INDEX)):
        parts = [torch.cat([x, x[:1].expand(rows - len(x), -1)]) for x in (getattr(b, name) for b in batches)]
        tensors.append(torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value) for x in parts]))
    return Batch([eid for b in batches for eid in b.example_ids + b.example_ids[:1] * (rows - len(b))], *tensors)


def make_batches(
    examples_df, model, cfg, batch_size: int, shuffle: bool, seed: int, bucket_by_length=False, bucket_batches=50
) -> list[Batch]:
    """Rows of ``examples_df`` -> Batches of ``model``'s tokenizer, tokenised by :func:`tokenize_pairs` (each pair
    once per process) with ``cfg``'s max lengths. With ``shuffle`` the order is a permutation from
    ``numpy.random.default_rng(seed)``. ``bucket_by_length`` cuts padding: chunks of ``bucket_batches * batch_size``
    examples of that order are sorted by (target, source) length, batched, and with ``shuffle`` the batches are
    permuted again with the same generator."""
    examples = tokenize_pairs(model.tokenizer, examples_df, cfg, model.decoder_start_token_id)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(examples)) if shuffle else np.arange(len(examples))
    chunk = bucket_batches * batch_size if bucket_by_length else max(len(order), 1)  # without buckets: one chunk
    groups = []
    for c in range(0, len(order), chunk):
        part = order[c : c + chunk]
        if bucket_by_length:
            keys = [(len(examples[j].labels), len(examples[j].input_ids)) for j in part]
            part = part[sorted(range(len(part)), key=keys.__getitem__)]
        groups += [part[i : i + batch_size] for i in range(0, len(part), batch_size)]
    if bucket_by_length and shuffle:
        groups = [groups[i] for i in rng.permutation(len(groups))]
    return [collate([examples[j] for j in g], model.pad_token_id, model.decoder_start_token_id) for g in groups]
