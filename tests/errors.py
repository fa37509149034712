"""What a test of an error message checks: what a user relies on, not the sentence.

An input or parameter error is one line that names where the problem is (the file and line or record, the params
key) and the offending value; its wording may change freely."""

from __future__ import annotations


def names(message: object, *parts: str) -> str:
    """Assert ``message`` is one line naming every part; returns the text for further checks."""
    text = str(message)
    assert "\n" not in text.strip(), f"not one line: {text!r}"
    missing = [p for p in parts if p not in text]
    assert not missing, f"{text!r} does not name {missing}"
    return text


def logs(lines: list[str], *parts: str) -> str:
    """Assert one of the log ``lines`` names every part (the client, the round, the file, the value); returns it.
    Log lines are read by people, so what they name matters and their wording and layout do not."""
    hits = [line for line in lines if all(p in line for p in parts)]
    assert hits, f"no log line names {list(parts)}: {lines!r}"
    return hits[0]
