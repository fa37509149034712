"""Sub-word token -> word mapping for target summaries (METHOD.md section 7 item 9): the POS analysis counts words.
A word is a maximal whitespace-delimited run of the target text, whatever the tokenizer ("lcd." and "isn't" are one
word each); special tokens and tokens that encode only whitespace (BPE ``Ċ``) belong to no word (``None``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class TargetWords:
    """The words of one target text and, per label position, the word each token belongs to."""

    word_index: list[int | None]  # per token position; None for special / whitespace-only tokens
    words: list[str]  # whitespace words of the text
    word_spans: list[tuple[int, int]]  # character span of each word in the text


def whitespace_words(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """The whitespace-delimited words of ``text`` and their character spans."""
    matches = list(_WORD.finditer(text))
    return [m.group() for m in matches], [m.span() for m in matches]


def char_to_word(text: str, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Array over characters: the index of the word containing each character, -1 for whitespace."""
    owner = np.full(len(text), -1, dtype=np.int64)
    for i, (start, end) in enumerate(spans):
        owner[start:end] = i
    return owner


def word_index_from_offsets(text: str, offsets: Sequence[tuple[int, int]], special: Sequence[bool]) -> TargetWords:
    """Map each token to the whitespace word containing its first non-space character. ``offsets`` are the tokenizer's
    character spans of the tokens in ``text``; ``special[i]`` marks special tokens. A zero-width token (BPE ``Ġ`` whose
    space was trimmed from its span) belongs to the word starting right at its position, if any: it encodes the space in
    front of that word."""
    words, spans = whitespace_words(text)
    owner = char_to_word(text, spans)
    index: list[int | None] = []
    for (start, end), is_special in zip(offsets, special):
        if is_special:
            index.append(None)
            continue
        if start == end:  # zero width
            index.append(int(owner[start]) if start < len(text) and owner[start] >= 0 else None)
            continue
        inside = owner[start:end]
        hit = inside[inside >= 0]
        index.append(int(hit[0]) if hit.size else None)  # whitespace-only token (Ċ, ĠĠ): no word
    return TargetWords(index, words, spans)
