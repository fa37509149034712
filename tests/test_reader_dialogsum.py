"""The one-file dataset reader extension, shown on DialogSum (pipeline/datasets/readers/dialogsum.py) and a small
fixture corpus in its upstream layout: registered on import, read through the registry end to end (the ingest
stage's function) to canonical records, its files and split keys where sources asks for them."""
from __future__ import annotations

import importlib
import json
import sys

import pytest

from pipeline.common.schema import DataError

TRAIN = [{"fname": "train_0", "dialogue": "#Person1#: Shall we meet at ten?\n#Person2#: Ten works.",
          "summary": "They meet at ten.", "topic": "meeting"},
         {"fname": "train_1", "dialogue": "#Person1#: The budget is late.\n#Person2#: I will send it\ntoday.",
          "summary": "#Person2# will send the budget today.", "topic": "budget"}]
DEV = [{"fname": "dev_0", "dialogue": "#Person1#: Hi.\n#Person2#: Hello.", "summary": "A greeting.",
        "topic": "greeting"}]
TEST = [{"fname": "test_0", "dialogue": "#Person1#: Is the room free?\n#Person2#: Until noon.",
         "summary1": "The room is free until noon.", "topic1": "room", "summary2": "s2", "topic2": "t2",
         "summary3": "s3", "topic3": "t3"}]


@pytest.fixture
def dialogsum():
    """The DialogSum reader module, imported (so registered) for this test only."""
    from pipeline.datasets.readers.registry import DATASETS

    module = importlib.import_module("pipeline.datasets.readers.dialogsum")
    assert "dialogsum" in DATASETS
    yield module
    DATASETS.pop("dialogsum")
    sys.modules.pop("pipeline.datasets.readers.dialogsum")


def _corpus(tmp_path, test=TEST):
    directory = tmp_path / "dialogsum"
    directory.mkdir()
    for split, rows in (("train", TRAIN), ("dev", DEV), ("test", test)):
        (directory / f"dialogsum.{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def test_a_fixture_corpus_reads_end_to_end_into_canonical_records(tmp_path, dialogsum):
    from pipeline.ingest import ingest_dataset

    frame, report = ingest_dataset("dialogsum", _corpus(tmp_path))
    assert list(frame["meeting_id"]) == ["train_0", "train_1", "dev_0", "test_0"]
    assert list(frame["split"]) == ["train", "train", "valid", "test"]  # dev -> valid
    assert set(frame["dataset"]) == {"dialogsum"} and set(frame["domain"]) == {"DialogSum"}
    assert list(frame["summary"]) == ["They meet at ten.", "#Person2# will send the budget today.", "A greeting.",
                                      "The room is free until noon."]  # the test split's first reference
    turns = [[(t["speaker"], t["content"]) for t in row] for row in frame["turns"]]
    assert turns[0] == [("#Person1#", "Shall we meet at ten?"), ("#Person2#", "Ten works.")]
    # a line without a speaker continues the previous turn
    assert turns[1] == [("#Person1#", "The budget is late."), ("#Person2#", "I will send it today.")]
    assert list(frame["source_line"]) == [1, 2, 1, 1]
    assert list(frame["source_file"]) == ["dialogsum/dialogsum.train.jsonl"] * 2 + [
        "dialogsum/dialogsum.dev.jsonl", "dialogsum/dialogsum.test.jsonl"]
    assert report.n_records == 4 and report.counts == {"DialogSum": {"train": 2, "valid": 1, "test": 1}}


def test_sources_read_its_files_and_split_keys_from_its_registration(tmp_path, dialogsum, monkeypatch):
    from pipeline.datasets import sources

    assert sources.expected_files("dialogsum") == ["dialogsum.train.jsonl", "dialogsum.dev.jsonl",
                                                   "dialogsum.test.jsonl"]
    cfg = sources.IngestConfig(datasets=["dialogsum"], allow_absent_splits=["dialogsum/DialogSum/valid"])
    assert sources._may_be_absent("dialogsum", "dialogsum.dev.jsonl", cfg)
    assert not sources._may_be_absent("dialogsum", "dialogsum.test.jsonl", cfg)
    corpus = _corpus(tmp_path)
    monkeypatch.setenv(sources.ENV_DATA_ROOT, str(tmp_path))
    assert sources.resolve_source("dialogsum", cfg, allow_download=False) == corpus  # a complete mirror
    (corpus / "dialogsum.test.jsonl").unlink()
    with pytest.raises(DataError) as err:
        sources.resolve_source("dialogsum", cfg, allow_download=False)
    assert "dialogsum.test.jsonl" in str(err.value)  # the incomplete mirror names its missing file


def test_a_test_line_without_its_references_names_file_and_line(tmp_path, dialogsum):
    from pipeline.ingest import ingest_dataset

    bad = [{k: v for k, v in TEST[0].items() if k != "summary3"}]
    with pytest.raises(DataError) as err:
        ingest_dataset("dialogsum", _corpus(tmp_path, test=bad))
    assert str(err.value).startswith("dialogsum/dialogsum.test.jsonl:1:") and "'summary3'" in str(err.value)
