"""DialogSum (Chen et al., Findings of ACL 2021): spoken everyday dialogues (meetings at work among them) with
summaries, as the authors' repository ships them: ``dialogsum.{train,dev,test}.jsonl``, one dialogue per line,
``#Person1#: ...`` turns separated by newlines. The test split has three reference summaries; the canonical record
keeps the first (``summary1``), as single-reference ROUGE here reads one."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pipeline.common.schema import CanonicalRecord, IngestReport, normalise_split
from pipeline.datasets.readers.registry import DatasetSpec, register_reader
from pipeline.datasets.readers.samsum import split_dialogue
from pipeline.datasets.readers.upstream import _object, _text, _Unique, split_json_lines

DIALOGSUM_SPLITS = ("train", "dev", "test")
TEST_FIELDS = ("fname", "dialogue", "summary1", "topic1", "summary2", "topic2", "summary3", "topic3")


def dialogsum_files() -> list[str]:
    return [f"dialogsum.{split}.jsonl" for split in DIALOGSUM_SPLITS]


def read_dialogsum(directory: Path, report: IngestReport, allow_absent: list[str] = ()) -> Iterator[CanonicalRecord]:
    dialogues = _Unique("dialogue fname")
    files = list(zip(DIALOGSUM_SPLITS, dialogsum_files()))
    for upstream_split, split, display, line_no, rec in split_json_lines(directory, files, "dialogsum/DialogSum",
                                                                          allow_absent, report):
        where = f"{display}:{line_no}"
        fname = _text(rec, "fname", where)
        rwhere = f"{where}: dialogue {fname}"
        if upstream_split == "test":
            _object(rec, rwhere, TEST_FIELDS)
        else:
            _object(rec, rwhere, ("fname", "dialogue", "summary", "topic"))
        dialogues.check(fname, where)
        summary = _text(rec, "summary1" if upstream_split == "test" else "summary", rwhere)
        yield CanonicalRecord(
            dataset="dialogsum", domain="DialogSum", split=split, meeting_id=fname, query_index=-1, query="",
            query_type="none", turns=split_dialogue(_text(rec, "dialogue", rwhere), rwhere, report), spans=[],
            summary=summary, source_file=display, source_line=line_no,
        )


register_reader(DatasetSpec(
    "dialogsum", read_dialogsum, dialogsum_files,
    lambda rel: f"dialogsum/DialogSum/{normalise_split(rel.split('.')[1])}",
))
