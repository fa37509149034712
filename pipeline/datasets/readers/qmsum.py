"""QMSum (Zhong et al. 2021): query-based meeting summarization, three domains, jsonl per domain and split
(``data/<Domain>/jsonl/{train,val,test}.jsonl``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.common.schema import QMSUM_DOMAINS, SPLIT_ALIASES, CanonicalRecord, DataError, IngestReport, Turn
from pipeline.datasets.readers.registry import DatasetSpec, register_reader
from pipeline.datasets.readers.upstream import UpstreamRecord, _unique, split_json_lines


class QMSumTurn(UpstreamRecord):
    speaker: str
    content: str


class QMSumQuery(UpstreamRecord):
    query: str
    answer: str


class QMSumSpecificQuery(QMSumQuery):
    relevant_text_span: list[Any]  # [start, end] pairs: _parse_span


class QMSumMeeting(UpstreamRecord):
    general_query_list: list[QMSumQuery]
    specific_query_list: list[QMSumSpecificQuery]
    meeting_transcripts: list[QMSumTurn]
    topic_list: Any = None


def qmsum_meeting_id(transcript: list[dict]) -> str:
    """QMSum's jsonl lines carry no meeting name, so a meeting is named by a hash of its transcript. The name is stable
    across mirrors and line orders (the Product train file was re-ordered, see SOURCE.md). The `examples` stage links
    Product/Academic meetings to their AMI/ICSI names."""
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


def qmsum_files() -> dict[str, str]:
    return {
        f"data/{d}/jsonl/{s}.jsonl": f"qmsum/{d}/{SPLIT_ALIASES[s]}"
        for d in QMSUM_DOMAINS
        for s in ("train", "val", "test")
    }


def read_qmsum(directory: Path, report: IngestReport, allow_absent: list[str] = ()) -> Iterator[CanonicalRecord]:
    meetings: dict[str, str] = {}  # meeting id -> where first read, over every file of the dataset
    for where, origin, meeting in split_json_lines(directory, qmsum_files(), allow_absent, report, QMSumMeeting):
        if not (turns := [Turn(t.speaker, t.content) for t in meeting.meeting_transcripts]):
            raise DataError(f"{where}: meeting_transcripts: empty transcript (no turns)")
        meeting_id = qmsum_meeting_id([t.model_dump() for t in meeting.meeting_transcripts])
        _unique(meetings, meeting_id, where, "meeting (identical transcript)")
        for query_type, key in (("general", "general_query_list"), ("specific", "specific_query_list")):
            for qi, q in enumerate(getattr(meeting, key)):
                qwhere = f"{where}: meeting {meeting_id} {key}[{qi}]"
                if not q.answer.strip():  # no target (skipping it would hide a general query's meeting from the link)
                    raise DataError(f"{qwhere}: empty answer")
                spans, selected = [], list(turns)  # a general query: the whole meeting
                if query_type == "specific":
                    spans = [_parse_span(s, len(turns), qwhere) for s in q.relevant_text_span]
                    # End-exclusive slices, in the order given (this reproduces Table II's turn counts).
                    selected = [t for start, end in spans for t in turns[start:end]]
                    if empty := sum(1 for start, end in spans if start == end):
                        report.note("specific spans with start == end (empty slice, kept)", empty)
                    if not selected:
                        report.note("specific queries whose spans select no turn (kept, query only)")
                yield CanonicalRecord(
                    **origin,
                    meeting_id=meeting_id,
                    query_index=qi,
                    query=q.query,
                    query_type=query_type,
                    turns=selected,
                    spans=spans,
                    summary=q.answer,
                )


QMSUM_URL = "https://raw.githubusercontent.com/Yale-LILY/QMSum/83d7768c1f2b4dfeb091385d3dc7e239b8e5bb7e"
register_reader(DatasetSpec("qmsum", read_qmsum, qmsum_files, url=QMSUM_URL))
