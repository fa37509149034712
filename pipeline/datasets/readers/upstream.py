"""What every reader of an upstream layout shares: JSON lines read with one-line errors naming file and line, fields
checked against the upstream schema (each reader's pydantic models), duplicate keys, and splits that may be absent
(ingest.allow_absent_splits)."""

from __future__ import annotations

import fnmatch
import gzip
import json
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.common.schema import DataError, IngestReport


def _json_lines(path: Path, display: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for every non-blank line. Every way a file can be unreadable becomes a DataError
    naming the file and, where there is one, the line: missing file, bytes that are not UTF-8, malformed JSON (a lone
    surrogate escape too), a truncated or damaged gzip chunk."""
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
                    raise DataError(
                        f"{display}:{line_no}: not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})"
                    ) from None
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    if "\\ud" in line.lower():  # a surrogate escape: JSON allows half a pair, UTF-8 text does not
                        json.dumps(obj, ensure_ascii=False).encode("utf-8")
                except json.JSONDecodeError as exc:
                    raise DataError(f"{display}:{line_no}: malformed JSON ({exc.msg} at column {exc.colno})") from None
                except (RecursionError, UnicodeEncodeError) as exc:
                    why = "nested too deeply" if isinstance(exc, RecursionError) else "half a surrogate pair"
                    raise DataError(f"{display}:{line_no}: malformed JSON ({why})") from None
                yield line_no, obj
    except (EOFError, OSError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{display}:{line_no + 1}: truncated or damaged file ({' '.join(str(exc).split())})") from None


class UpstreamRecord(BaseModel):
    """An upstream record's pydantic model: strict JSON types (null or a number where text belongs is an error, not the
    text "None") and no unknown field (a file of another format or version is named instead of being read wrongly)."""

    model_config = ConfigDict(strict=True, extra="forbid")


Record = TypeVar("Record", bound=UpstreamRecord)


def parse_record(model: type[Record], obj: Any, where: str) -> Record:
    """``obj`` as ``model``; its first problem is one DataError line: ``where``, the field's path and the problem."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        error = exc.errors()[0]
        # a key that is not a plain name (an upstream key may hold anything, a line break too) is quoted as JSON
        path = "".join(
            f"[{p}]" if isinstance(p, int) else f".{p}" if p.isidentifier() else f"[{json.dumps(p)}]"
            for p in error["loc"]
        ).lstrip(".")
        problem = "expected a JSON object" if error["type"] == "model_type" else error["msg"]
        got = "" if error["type"] in ("missing", "extra_forbidden") else f", got {json.dumps(error['input'])[:60]}"
        raise DataError(f"{where}: {path + ': ' if path else ''}{problem}{got}") from None


def absent_allowed(split_key: str, allow_absent: list[str]) -> bool:
    """Whether ``ingest.allow_absent_splits`` (fnmatch patterns) lets split ``<dataset>/<domain>/<split>`` be absent."""
    return any(fnmatch.fnmatchcase(split_key, pat) for pat in allow_absent)


def _unique(seen: dict[Any, str], key: Any, where: str, what: str) -> None:
    """``key`` not among the record keys ``seen`` so far (key -> where): a duplicate names both places."""
    if (first := seen.setdefault(key, where)) != where:
        raise DataError(f"{where}: duplicate {what} {key!r} (first at {first})")


def split_json_lines(
    directory: Path, files: dict[str, str], allow_absent: list[str], report: IngestReport, model: type[Record]
) -> Iterator[tuple[str, dict[str, Any], Record]]:
    """The JSON lines of a dataset's split files, ``files`` as its registration declares them (file -> split key
    ``<dataset>/<domain>/<split>``), each parsed as ``model``: yields (``<dataset>/<file>:<line>`` for errors, the
    record's CanonicalRecord fields dataset, domain, split, source_file and source_line, record). An absent split
    file is skipped (counted) only where ``allow_absent`` names its split key; a file without a line is an error unless
    allowed and the split's only file (one empty chunk of a split that has others is a damaged copy)."""
    files_of = Counter(files.values())
    for name, split_key in files.items():
        dataset, domain, split = split_key.split("/")
        display = f"{dataset}/{name}"
        if not (directory / name).is_file() and absent_allowed(split_key, allow_absent):
            report.note(f"absent split files allowed by ingest.allow_absent_splits ({split_key})")
            continue
        line_no = 0  # still 0 after the loop: the file has no record
        for line_no, rec in _json_lines(directory / name, display):
            origin = dict(dataset=dataset, domain=domain, split=split, source_file=display, source_line=line_no)
            yield f"{display}:{line_no}", origin, parse_record(model, rec, f"{display}:{line_no}")
        if line_no == 0 and not (files_of[split_key] == 1 and absent_allowed(split_key, allow_absent)):
            raise DataError(
                f"{display}: no records (empty or blank file) for split {split_key}; if that split may "
                f"be absent, add {split_key!r} to ingest.allow_absent_splits"
            )
