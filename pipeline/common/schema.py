"""Typed records shared by the data stages (docs/ARCHITECTURE.md, "Records"), and the error raised for bad input."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPLITS = ("train", "valid", "test")
QMSUM_DOMAINS = ("Academic", "Committee", "Product")
# QMSum domain whose meetings are those of another corpus, with a different split (METHOD.md section 2).
SHARED_MEETINGS = {"Product": "ami", "Academic": "icsi"}

# Upstream split names -> ours (QMSum `val`, SAMSum `validation`, HMNet `dev`).
SPLIT_ALIASES = {"train": "train", "test": "test"} | dict.fromkeys(("val", "valid", "validation", "dev"), "valid")


class DataError(ValueError):
    """Bad input data. The message names the file, the line or record, and the problem."""


def read_json(path: Path, what: str = "JSON file", kind: type = dict) -> Any:
    """What an earlier stage wrote to ``path``, a JSON object (``kind`` dict) or array (list); a missing file, invalid
    JSON or another kind is a one-line DataError naming ``what``."""
    if not path.is_file():
        raise DataError(f"{path}: {what} not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:  # bytes that are not UTF-8 are no JSON either
        raise DataError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, kind):
        raise DataError(f"{path}: expected a JSON {'object' if kind is dict else 'array'} ({what})")
    return data


def read_parquet(path: Path, what: str, columns: list = (), every: bool = False) -> Any:
    """The ``columns`` (Arrow fields; ``every`` or none given: and the table's other columns, unchecked) of the table
    an earlier stage wrote to ``path``, a DataFrame; a missing or unreadable file, a missing column, one of another
    type (pandas' large_string is a string) or a null value is a one-line DataError naming ``what``."""
    import pandas as pd  # lazy, as pyarrow in canonical_arrow_schema (the CLIs that import this module need neither)
    import pyarrow as pa  # lazy, as pandas
    import pyarrow.parquet as pq  # lazy, as pandas

    if not path.is_file():
        raise DataError(f"{path}: {what} not found")
    try:
        found = pq.read_schema(path)
        names = None if every or not columns else [c.name for c in columns if c.name in found.names]
        frame = pd.read_parquet(path, columns=names)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable {what} ({' '.join(str(err).split())})") from None
    for col in columns:
        got = found.field(col.name).type if col.name in found.names else None
        if got not in (col.type, pa.large_string() if col.type == pa.string() else col.type):
            raise DataError(f"{path}: {what}: column {col.name} is {got or 'missing'}, expected {col.type}")
        if (nulls := frame[col.name].isna()).any():
            raise DataError(f"{path}: {what}: column {col.name} is null in row {int(nulls.to_numpy().argmax())}")
    return frame


@dataclass(frozen=True)
class Turn:
    speaker: str
    content: str


def model_input(query: str, turns: list[Turn], sep_token: str) -> str:
    """The model's source text (examples and the backbone warm-up): one turn a line, after ``query #SEP#``, each
    ``Speaker: content`` (names and roles stay ordinary words)."""
    transcript = "\n".join(f"{t.speaker}: {t.content}" for t in turns)
    return f"{query} {sep_token} {transcript}" if query else transcript


@dataclass
class CanonicalRecord:
    dataset: str
    domain: str
    split: str
    meeting_id: str
    turns: list[Turn]
    summary: str
    source_file: str
    source_line: int
    # a query's (QMSum); a dialogue or meeting corpus has one summary a record and no query
    query_index: int = -1
    query: str = ""
    query_type: str = "none"
    spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Example:
    example_id: str
    dataset: str
    domain: str
    split: str
    meeting_id: str
    query: str
    query_type: str
    source: str
    target: str
    n_turns: int
    n_speakers: int
    n_words: int
    n_summary_words: int


@dataclass
class Skipped:
    """A record left out by design (e.g. an empty SAMSum dialogue): always counted and reported."""

    source_file: str
    source_line: int
    record: str
    reason: str


@dataclass
class IngestReport:
    dataset: str
    source: str  # where the files were read from (mirror directory or download directory)
    n_records: int = 0
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # domain -> split -> records
    query_types: dict[str, int] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)  # repairs applied while parsing, counted
    skipped: list[Skipped] = field(default_factory=list)

    def count(self, rec: CanonicalRecord) -> None:
        self.n_records += 1
        by_split = self.counts.setdefault(rec.domain, {})
        by_split[rec.split] = by_split.get(rec.split, 0) + 1
        self.query_types[rec.query_type] = self.query_types.get(rec.query_type, 0) + 1

    def note(self, what: str, n: int = 1) -> None:
        self.notes[what] = self.notes.get(what, 0) + n

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {
            "n_skipped": len(self.skipped),
            "skipped_by_reason": dict(Counter(s.reason for s in self.skipped)),
        }


# Word counters of the statistics (METHOD.md section 2, Table II).
_DISFLUENCY_TAG = re.compile(r"\{[^}]*\}")


def summary_word_count(text: str) -> int:
    """Words of a summary as the paper counts them: ``str.split(' ')`` per line. Splitting on single spaces (so a double
    space counts an empty word) reproduces all nine Table II "avg. summary words" values exactly; plain ``split()`` is
    up to 0.12 lower. Multi-sentence summaries (AMI/ICSI, one sentence per line) are counted line by line."""
    return sum(len(line.split(" ")) for line in text.split("\n"))


def spoken_word_count(turn: Turn) -> int:
    """Words spoken in a turn: whitespace words of ``speaker + content`` with ``{...}`` tags removed. The paper's
    counter is unknown; this one comes within 1-2.5 % of Table II (METHOD.md section 2)."""
    return len(_DISFLUENCY_TAG.sub("", f"{turn.speaker} {turn.content}").split())


def canonical_arrow_schema():
    """Explicit Arrow types, so a dataset whose spans are all empty (AMI, ICSI, SAMSum) still reads back the same."""
    import pyarrow as pa  # lazy: ~0.1 s; the presets and federation CLIs import this module without it

    return pa.schema(
        [
            ("dataset", pa.string()),
            ("domain", pa.string()),
            ("split", pa.string()),
            ("meeting_id", pa.string()),
            ("query_index", pa.int64()),
            ("query", pa.string()),
            ("query_type", pa.string()),
            ("turns", pa.list_(pa.struct([("speaker", pa.string()), ("content", pa.string())]))),
            ("spans", pa.list_(pa.list_(pa.int64()))),
            ("summary", pa.string()),
            ("source_file", pa.string()),
            ("source_line", pa.int64()),
        ]
    )
