"""The readers of the datasets' upstream layouts, one per dataset, registered in :data:`READERS`.

Each yields canonical records (pipeline.common.schema.CanonicalRecord) and counts what it leaves out by design in
the ingest report; bad input raises DataError naming file, line and problem. Adding a dataset: its reader and
registry entry here, where its files come from in pipeline.datasets.sources, and its name in params.yaml
``ingest.datasets``.
"""
from __future__ import annotations

import fnmatch
import gzip
import hashlib
import json
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pipeline.common.schema import (
    QMSUM_DOMAINS,
    CanonicalRecord,
    DataError,
    IngestReport,
    Skipped,
    Turn,
    normalise_split,
)
from pipeline.datasets.sources import HMNET_CHUNKS, HMNET_CORPUS, HMNET_PREFIX, SAMSUM_FILES


def _json_lines(path: Path, display: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for every non-blank line.

    Every way a file can be unreadable becomes a DataError naming the file and, where there is one, the line:
    missing file, bytes that are not UTF-8, malformed JSON, a truncated or damaged gzip chunk.
    """
    if not path.is_file():
        raise DataError(f"{display}: expected split file is missing")
    opener = gzip.open if path.suffix == ".gz" else open
    line_no = 0
    try:
        with opener(path, "rb") as fh:
            for line_no, raw in enumerate(fh, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(f"{display}:{line_no}: not UTF-8 (byte {raw[exc.start]:#04x} at column "
                                    f"{exc.start + 1})") from None
                if not line.strip():
                    continue
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{display}:{line_no}: malformed JSON ({exc.msg} at column {exc.colno})") from None
                except RecursionError:
                    raise DataError(f"{display}:{line_no}: malformed JSON (nested too deeply)") from None
    except (EOFError, OSError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{display}:{line_no + 1}: truncated or damaged file ({' '.join(str(exc).split())})") from None


def _object(obj: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    """``obj`` as a JSON object with exactly the upstream fields: a list, a number or an unknown field (a file of
    another format or version) is named instead of being read wrongly."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {_json_type(obj)}")
    for name in required:
        if name not in obj:
            raise DataError(f"{where}: missing field {name!r}")
    extra = sorted(set(obj) - set(required) - set(optional))
    if extra:
        raise DataError(f"{where}: unexpected field(s) {extra}; expected {sorted(required + optional)}")
    return obj


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
             int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


_FIELD_KINDS = {str: "a string", list: "a list", dict: "an object"}  # what an upstream field can be expected to be


def _field(obj: Any, name: str, where: str, kind: type) -> Any:
    """``obj[name]``, which must be of ``kind`` (str, list or dict): JSON's true and false are not strings,
    lists or objects, so no separate check for them is needed."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {_json_type(obj)}")
    if name not in obj:
        raise DataError(f"{where}: missing field {name!r}")
    value = obj[name]
    if not isinstance(value, kind):
        raise DataError(f"{where}: field {name!r} is {_json_type(value)}, expected {_FIELD_KINDS[kind]}")
    return value


def _text(obj: Any, name: str, where: str) -> str:
    """A text field: a string (null or a number where text belongs is an error, not the text "None")."""
    return _field(obj, name, where, str)


def _no_records(display: str, split_key: str, allow: list[str]) -> None:
    """An empty split file is an error unless ``ingest.allow_absent_splits`` names its split."""
    if not any(fnmatch.fnmatchcase(split_key, pat) for pat in allow):
        raise DataError(f"{display}: no records (empty or blank file) for split {split_key}; if that split may be "
                        f"absent, add {split_key!r} to ingest.allow_absent_splits")


class _Unique:
    """Record keys seen so far: a duplicate names both places."""

    def __init__(self, what: str):
        self.what = what
        self.seen: dict[Any, str] = {}

    def check(self, key: Any, where: str) -> None:
        if key in self.seen:
            raise DataError(f"{where}: duplicate {self.what} {key!r} (first at {self.seen[key]})")
        self.seen[key] = where


# ---------------------------------------------------------------------------------------------- QMSum
def qmsum_meeting_id(transcript: list[dict]) -> str:
    """QMSum's jsonl lines carry no meeting name, so a meeting is named by a hash of its transcript.

    The name is stable across mirrors and line orders (the Product train file was re-ordered, see
    SOURCE.md). The `examples` stage links Product/Academic meetings to their AMI/ICSI names.
    """
    text = json.dumps([[t["speaker"], t["content"]] for t in transcript], ensure_ascii=True)
    return "m" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:10]


def _parse_span(raw: Any, n_turns: int, where: str) -> tuple[int, int]:
    if not isinstance(raw, (list, tuple)) or len(raw) != 2:
        raise DataError(f"{where}: span {raw!r} is not a [start, end] pair")
    try:
        # Upstream writes indices as strings ("29"); ints are fine too, floats and booleans are not.
        if any(isinstance(x, (bool, float)) for x in raw):
            raise TypeError
        start, end = int(raw[0]), int(raw[1])
    except (TypeError, ValueError):
        raise DataError(f"{where}: span {raw!r} has a non-integer index") from None
    if start > end:
        raise DataError(f"{where}: span [{start}, {end}] is reversed")
    if start < 0 or end > n_turns:
        raise DataError(f"{where}: span [{start}, {end}] is out of range for a meeting of {n_turns} turns")
    return start, end


QMSUM_MEETING_FIELDS = ("topic_list", "general_query_list", "specific_query_list", "meeting_transcripts")


def read_qmsum(directory: Path, report: IngestReport, allow_absent: list[str] = ()) -> Iterator[CanonicalRecord]:
    for domain in QMSUM_DOMAINS:
        for upstream_split in ("train", "val", "test"):
            rel = f"data/{domain}/jsonl/{upstream_split}.jsonl"
            display = f"qmsum/{rel}"
            split = normalise_split(upstream_split, display)
            split_key = f"qmsum/{domain}/{split}"
            if _absent_allowed(directory / rel, split_key, allow_absent, report):
                continue
            meetings = _Unique("meeting (identical transcript)")
            n_lines = 0
            for line_no, meeting in _json_lines(directory / rel, display):
                n_lines += 1
                where = f"{display}:{line_no}"
                _object(meeting, where, QMSUM_MEETING_FIELDS[1:], QMSUM_MEETING_FIELDS[:1])
                transcript = _field(meeting, "meeting_transcripts", where, list)
                turns = []
                for i, t in enumerate(transcript):
                    twhere = f"{where}: meeting_transcripts[{i}]"
                    _object(t, twhere, ("speaker", "content"))
                    turns.append(Turn(_text(t, "speaker", twhere), _text(t, "content", twhere)))
                meeting_id = qmsum_meeting_id(transcript)
                meetings.check(meeting_id, where)
                for query_type, key in (("general", "general_query_list"), ("specific", "specific_query_list")):
                    for qi, q in enumerate(_field(meeting, key, where, list)):
                        qwhere = f"{where}: meeting {meeting_id} {key}[{qi}]"
                        _object(q, qwhere, ("query", "answer") + (("relevant_text_span",) if query_type == "specific"
                                                                     else ()))
                        query = _text(q, "query", qwhere)
                        answer = _text(q, "answer", qwhere)
                        if query_type == "specific":
                            spans = [_parse_span(s, len(turns), qwhere)
                                     for s in _field(q, "relevant_text_span", qwhere, list)]
                            # End-exclusive slices, in the order given (this reproduces Table II's turn counts).
                            selected = [t for start, end in spans for t in turns[start:end]]
                            empty = sum(1 for start, end in spans if start == end)
                            if empty:
                                report.note("specific spans with start == end (empty slice, kept)", empty)
                            if not selected:
                                report.note("specific queries whose spans select no turn (kept, query only)")
                        else:
                            spans, selected = [], list(turns)
                        yield CanonicalRecord(
                            dataset="qmsum", domain=domain, split=split, meeting_id=meeting_id,
                            query_index=qi, query=query, query_type=query_type, turns=selected, spans=spans,
                            summary=answer, source_file=display, source_line=line_no,
                        )
            if n_lines == 0:
                _no_records(display, split_key, allow_absent)


def _absent_allowed(path: Path, split_key: str, allow_absent: list[str], report: IngestReport) -> bool:
    """True when the split file is missing and ``ingest.allow_absent_splits`` allows it (counted in the report)."""
    if path.is_file() or not any(fnmatch.fnmatchcase(split_key, pat) for pat in allow_absent):
        return False
    report.note(f"absent split files allowed by ingest.allow_absent_splits ({split_key})")
    return True


# ---------------------------------------------------------------------------------------------- AMI / ICSI
def hmnet_speaker(turn: dict, where: str) -> str:
    """``"<role> <letter>"``, e.g. ``"PM B"`` or ``"Grad F"``.

    This is the form QMSum's Academic transcripts use for the same ICSI meetings ("Grad F", "PhD C"): the
    role carries meaning a summarizer can use ("the project manager said ..."), and the letter keeps two
    participants with the same role (common in ICSI) apart.
    """
    letter = _text(turn, "speaker", where)
    role = turn.get("role")
    if role is not None and not isinstance(role, str):
        raise DataError(f"{where}: field 'role' is {_json_type(role)}, expected a string")
    role = (role or "").strip()
    return f"{role} {letter}" if role else letter


def read_hmnet(directory: Path, dataset: str, report: IngestReport,
               allow_absent: list[str] = ()) -> Iterator[CanonicalRecord]:
    corpus = HMNET_CORPUS[dataset]
    meetings = _Unique("meeting id")
    for upstream_split, n_chunks in HMNET_CHUNKS[dataset].items():
        split = normalise_split(upstream_split)
        split_key = f"{dataset}/{corpus}/{split}"
        for k in range(n_chunks):
            rel = f"{HMNET_PREFIX}ExampleRawData/meeting_summarization/{corpus}_proprec/{upstream_split}/split_{k}.jsonl.gz"
            display = f"{dataset}/{rel}"
            if _absent_allowed(directory / rel, split_key, allow_absent, report):
                continue
            n_lines = 0
            for line_no, meeting in _json_lines(directory / rel, display):
                n_lines += 1
                where = f"{display}:{line_no}"
                meeting_id = _text(meeting, "id", where)
                mwhere = f"{where}: meeting {meeting_id}"
                _object(meeting, mwhere, ("id", "meeting", "summary"))
                meetings.check(meeting_id, where)
                turns = []
                for i, utt in enumerate(_field(meeting, "meeting", mwhere, list)):
                    twhere = f"{mwhere} meeting[{i}]"
                    _object(utt, twhere, ("speaker", "utt"), ("role",))
                    if not str(utt.get("role") or "").strip():
                        report.note("turns without a role (speaker letter only)")
                    words = _field(_field(utt, "utt", twhere, dict), "word", f"{twhere}.utt", list)
                    bad = next((j for j, w in enumerate(words) if not isinstance(w, str)), None)
                    if bad is not None:
                        raise DataError(f"{twhere}.utt.word[{bad}]: {_json_type(words[bad])}, expected a string")
                    turns.append(Turn(hmnet_speaker(utt, twhere), " ".join(words)))
                sentences = _field(meeting, "summary", mwhere, list)
                bad = next((j for j, x in enumerate(sentences) if not isinstance(x, str)), None)
                if bad is not None:
                    raise DataError(f"{mwhere}: summary[{bad}] is {_json_type(sentences[bad])}, expected a string")
                if not turns or not sentences:
                    raise DataError(f"{mwhere}: empty {'transcript' if not turns else 'summary'}")
                yield CanonicalRecord(
                    dataset=dataset, domain=corpus, split=split, meeting_id=meeting_id, query_index=-1,
                    query="", query_type="none", turns=turns, spans=[],
                    summary="\n".join(s.strip() for s in sentences),
                    source_file=display, source_line=line_no,
                )
            if n_lines == 0:
                # One empty chunk of a split that has others is a damaged copy, never an allowed absence.
                _no_records(display, split_key, allow_absent if n_chunks == 1 else [])


# ---------------------------------------------------------------------------------------------- SAMSum
_TURN_SEP = re.compile(r"\r\n|\n")


def split_dialogue(dialogue: str, where: str, report: IngestReport) -> list[Turn]:
    """``Speaker: text`` lines -> turns, split at the first ``": "``.

    A few upstream lines lack the space (``"Phil:<file_photo>"``): those split at the first ``":"``. A line
    with no colon at all continues the previous turn. Both repairs are counted in the report.
    """
    turns: list[Turn] = []
    for line in _TURN_SEP.split(dialogue):
        if not line.strip():
            report.note("blank dialogue lines (dropped)")
            continue
        if ": " in line:
            speaker, content = line.split(": ", 1)
        elif ":" in line:
            speaker, content = line.split(":", 1)
            report.note("turns split at ':' without a following space")
        elif turns:
            turns[-1] = Turn(turns[-1].speaker, f"{turns[-1].content} {line.strip()}")
            report.note("lines without a speaker appended to the previous turn")
            continue
        else:
            raise DataError(f"{where}: first dialogue line has no 'Speaker:' prefix: {line[:60]!r}")
        turns.append(Turn(speaker.strip(), content.strip()))
    return turns


def read_samsum(directory: Path, report: IngestReport, allow_absent: list[str] = ()) -> Iterator[CanonicalRecord]:
    dialogues = _Unique("dialogue id")
    for name in SAMSUM_FILES:
        display = f"samsum/{name}"
        split = normalise_split(name.removesuffix(".json"), display)
        split_key = f"samsum/SAMSum/{split}"
        if _absent_allowed(directory / name, split_key, allow_absent, report):
            continue
        n_lines = 0
        for line_no, rec in _json_lines(directory / name, display):
            n_lines += 1
            where = f"{display}:{line_no}"
            rid = _text(rec, "id", where)
            rwhere = f"{where}: dialogue {rid}"
            _object(rec, rwhere, ("id", "dialogue", "summary"))
            dialogues.check(rid, where)
            dialogue = _text(rec, "dialogue", rwhere)
            summary = _text(rec, "summary", rwhere)
            if not dialogue.strip():
                report.skipped.append(Skipped(display, line_no, rid, "empty dialogue"))
                continue
            yield CanonicalRecord(
                dataset="samsum", domain="SAMSum", split=split, meeting_id=rid, query_index=-1, query="",
                query_type="none", turns=split_dialogue(dialogue, rwhere, report), spans=[], summary=summary,
                source_file=display, source_line=line_no,
            )
        if n_lines == 0:
            _no_records(display, split_key, allow_absent)


# dataset name -> reader(directory, report, allow_absent) (params.yaml ingest.datasets names these)
Reader = Callable[[Path, IngestReport, list[str]], Iterator[CanonicalRecord]]
READERS: dict[str, Reader] = {
    "qmsum": read_qmsum,
    "samsum": read_samsum,
    **{corpus: (lambda d, r, a, corpus=corpus: read_hmnet(d, corpus, r, a)) for corpus in HMNET_CORPUS},
}
