"""Sub-word token -> word mapping for target summaries (METHOD.md section 7 item 9).

The POS analysis counts *words*, not sub-word tokens ("project manager decides to use lcd" has 6 words however
the tokenizer splits it). A **word** here is a maximal whitespace-delimited run of the target text, so the
definition does not depend on the tokenizer: "lcd." and "isn't" are one word each. Special tokens (``<s>``,
``</s>``, ``[CLS]``, ``[SEP]``, padding) and tokens that encode only whitespace (BPE ``Ċ``, a lone ``Ġ`` before
a space) belong to no word (``None``).

Three ways to get the mapping:
- :func:`word_index_from_offsets` - from a fast tokenizer's character offsets (any fast tokenizer; what the
  pipeline uses, because it also gives the characters that spaCy's tags are aligned to);
- :func:`word_index_from_markers` with ``scheme="bpe"`` - byte-level BPE tokens (BART, RoBERTa, GPT-2), where
  ``Ġ`` marks a preceding space: gives exactly the whitespace words;
- :func:`word_index_from_markers` with ``scheme="wordpiece"`` - WordPiece tokens (BERT), where ``##`` marks a
  continuation. WordPiece strings carry no whitespace, so punctuation split off by BERT's pre-tokenizer becomes
  its own word ("lcd." -> "lcd", "."); use offsets when the text is available.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BPE_SPACE = "Ġ"  # byte-level BPE's visible form of " "
BPE_WHITESPACE = frozenset("ĠĊčĉ")  # visible forms of space, \n, \r, \t
WORDPIECE_CONTINUATION = "##"

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


def word_index_from_offsets(
    text: str, offsets: Sequence[tuple[int, int]], special: Sequence[bool]
) -> TargetWords:
    """Map each token to the whitespace word containing its first non-space character.

    ``offsets`` are the tokenizer's character spans of the tokens in ``text``; ``special[i]`` marks special
    tokens. A zero-width token (BPE ``Ġ`` whose space was trimmed from its span) belongs to the word starting
    right at its position, if any: it encodes the space in front of that word.
    """
    if len(offsets) != len(special):
        raise ValueError(f"{len(offsets)} offsets but {len(special)} special-token flags")
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


def word_index_from_markers(
    tokens: Sequence[str], scheme: str, special: Sequence[bool] | None = None
) -> list[int | None]:
    """Word index of each token from the tokenizer's own word-boundary markers.

    scheme ``"bpe"``: a token starting with ``Ġ`` starts a word, so does the first token after a special or
    whitespace-only token; a whitespace-only token (``Ċ``, ``ĠĠ``, a lone ``Ġ``) belongs to no word, except a
    lone ``Ġ`` directly followed by a word's first piece (``Ġ`` ``L`` ``CD`` = " LCD"), which starts that word.
    scheme ``"wordpiece"``: a token not starting with ``##`` starts a word.
    """
    special = list(special) if special is not None else [False] * len(tokens)
    if len(special) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(special)} special-token flags")
    if scheme == "wordpiece":
        out: list[int | None] = []
        current = -1
        for tok, is_special in zip(tokens, special):
            if is_special:
                out.append(None)
                continue
            if not tok.startswith(WORDPIECE_CONTINUATION) or current < 0:
                current += 1
            out.append(current)
        return out
    if scheme != "bpe":
        raise ValueError(f"unknown word-marker scheme {scheme!r}; expected 'bpe' or 'wordpiece'")

    def whitespace_only(tok: str) -> bool:
        return all(ch in BPE_WHITESPACE for ch in tok)

    out = []
    current = -1
    open_word = False  # whether the previous token left a word open for continuation pieces
    for i, (tok, is_special) in enumerate(zip(tokens, special)):
        if is_special:
            out.append(None)
            open_word = False
            continue
        if whitespace_only(tok):
            nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
            starts_next = (
                tok == BPE_SPACE
                and i + 1 < len(tokens)
                and not special[i + 1]
                and nxt[:1] not in BPE_WHITESPACE
            )
            if starts_next:
                current += 1
                out.append(current)
                open_word = True
            else:
                out.append(None)
                open_word = False
            continue
        if tok.startswith(BPE_SPACE) or not open_word:
            current += 1
        out.append(current)
        open_word = True
    return out
