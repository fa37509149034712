"""Sub-word -> word mapping on byte-level BPE and WordPiece tokenizations (expected indices written by hand)."""

from __future__ import annotations

from tiny_models import _bart_tokenizer, _bert_tokenizer

from pipeline.modeling.target_tags import word_index_from_offsets

TEXT = "The project manager decides to use LCD.\nHe isn't  sure, ok?"
# Whitespace words of TEXT, by hand.
WORDS = ["The", "project", "manager", "decides", "to", "use", "LCD.", "He", "isn't", "sure,", "ok?"]


def test_whitespace_words():
    _, words, spans = word_index_from_offsets(TEXT, [], [])
    assert words == WORDS
    assert spans[6] == (35, 39) and spans[7] == (40, 42)


def _encode(tok, text):
    enc = tok(text_target=text, return_offsets_mapping=True, return_special_tokens_mask=True)
    special = [bool(s) for s in enc["special_tokens_mask"]]
    return tok.convert_ids_to_tokens(enc["input_ids"]), enc["offset_mapping"], special


def test_wordpiece_offsets_real_tokenizer():
    tokens, offsets, special = _encode(_bert_tokenizer(), TEXT)
    assert tokens == [
        "[CLS]",
        "the",
        "project",
        "manager",
        "decides",
        "to",
        "use",
        "lcd",
        ".",
        "he",
        "isn",
        "'",
        "t",
        "sure",
        ",",
        "ok",
        "?",
        "[SEP]",
    ]
    word_index, words, _ = word_index_from_offsets(TEXT, offsets, special)
    assert words == WORDS
    assert word_index == [None, 0, 1, 2, 3, 4, 5, 6, 6, 7, 8, 8, 8, 9, 9, 10, 10, None]


def test_bpe_offsets_real_tokenizer():
    tokens, offsets, special = _encode(_bart_tokenizer(), TEXT)
    word_index, _, _ = word_index_from_offsets(TEXT, offsets, special)
    # The pieces of each word spell the word (Ġ = the space in front of it); specials, Ċ and the lone Ġ of the
    # double space belong to no word.
    for w, word in enumerate(WORDS):
        pieces = [t for t, i in zip(tokens, word_index) if i == w]
        assert "".join(pieces).replace("Ġ", "") == word
    assert [t for t, i in zip(tokens, word_index) if i is None] == ["<s>", "Ċ", "Ġ", "</s>"]
