"""The client model: a frozen encoder-decoder with two adapter sets, ``global`` (the server's aggregate, the teacher,
never trained) and ``local`` (the client's summarizer, the only trainable parameters), on its top k decoder layers
(METHOD.md s. 3; docs/ARCHITECTURE.md, Model). Everything below the first adapted layer does not depend on the path,
so :meth:`forward_two_paths` computes that :class:`Prefix` once (cacheable: pipeline.modeling.cache) and runs only the
top k layers and the LM head per path. Adapters are forward hooks, so every HF code path (``generate`` included) sees
the active path's. The backbone always runs in eval mode: a deterministic prefix is what makes the cache exact."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pipeline.common.config import ConfigError
from pipeline.common.integrity import check_model_dir
from pipeline.experiments.model import ModelConfig
from pipeline.modeling.adapter_stack import AdapterStack
from pipeline.modeling.adapters import AdapterConfig, AdapterSet, output_layer_norm
from pipeline.modeling.batching import IGNORE_INDEX, Batch

PATHS = ("global", "local")


def adapter_config(model: ModelConfig) -> AdapterConfig:
    """The adapter sets of the ``model`` params group (its shape keys: pipeline.experiments.plans.ModelConfig)."""
    return AdapterConfig(model.top_k, model.bottleneck, model.adapter_bias, model.adapter_init_std)


@dataclass
class Prefix:
    """What the top k decoder layers need, batched and right-padded like the Batch it belongs to."""

    encoder_hidden: torch.Tensor  # [B, S, n] encoder output as the decoder's cross-attention sees it
    encoder_mask: torch.Tensor  # [B, S] 1 on source tokens
    decoder_hidden: torch.Tensor  # [B, T, n] hidden state entering decoder layer L-k (valid up to target length)
    target_mask: torch.Tensor  # [B, T] bool, True on real target tokens (labels != -100): the LM head runs only there

    @classmethod
    def of(cls, batch: Batch, encoder_hidden: torch.Tensor, decoder_hidden: torch.Tensor) -> Prefix:
        """``batch``'s prefix from its hidden states, its masks on their device (to a GPU: an asynchronous copy)."""
        to = functools.partial(torch.Tensor.to, device=decoder_hidden.device, non_blocking=decoder_hidden.is_cuda)
        return cls(encoder_hidden, to(batch.attention_mask), decoder_hidden, to(batch.labels != IGNORE_INDEX))

    def repeat(self, runs: int) -> Prefix:
        """``runs`` copies, run-major (the rows an AdapterStack of ``runs`` runs reads)."""
        if runs == 1:
            return self
        return Prefix(**{name: torch.cat([tensor] * runs) for name, tensor in vars(self).items()})


class _PrefixReady(Exception):
    """Raised from a pre-hook to stop the backbone forward once the prefix has been captured."""


class AdapterSummarizer(nn.Module):
    def __init__(
        self, backbone: nn.Module, tokenizer, adapter: AdapterConfig, device: torch.device | str | None = None
    ):
        super().__init__()
        if len(tokenizer) > backbone.get_input_embeddings().num_embeddings:
            raise ValueError(
                f"tokenizer has {len(tokenizer)} tokens but the model's embeddings only "
                f"{backbone.get_input_embeddings().num_embeddings}; resize the embeddings first"
            )
        keys = ("decoder_start_token_id", "pad_token_id", "eos_token_id")  # where generation_config leaves them unset
        backbone.generation_config.update(defaults_only=True, **{k: getattr(backbone.config, k, None) for k in keys})
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.adapter_config = adapter
        self.is_bert2bert = getattr(backbone.config, "model_type", "") == "encoder-decoder"
        self.backbone.requires_grad_(False)

        # Views into the backbone, kept out of nn.Module registration (via __dict__) so that the backbone's
        # modules are not registered twice under other names.
        if self.is_bert2bert:  # e.g. a BertLMHeadModel and its BertModel (is_decoder=True)
            self.__dict__.update(_head_owner=backbone.decoder, _stack=backbone.decoder.base_model)
            layers = self._stack.encoder.layer
        else:
            self.__dict__.update(_head_owner=backbone, _stack=backbone.get_decoder())
            layers = getattr(self._stack, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"{type(backbone).__name__}: cannot find the decoder layers (unsupported architecture)")
        n_layers = len(layers)
        if adapter.top_k > n_layers:
            raise ConfigError(
                f"model.top_k={adapter.top_k} > {n_layers} decoder layers of {type(backbone).__name__}; "
                f"allowed: 1..{n_layers}"
            )
        self.first_adapted = n_layers - adapter.top_k
        self._top_layers = list(layers[self.first_adapted :])
        self.hidden_size = self._stack.config.hidden_size if self.is_bert2bert else backbone.config.d_model
        for key in keys[:2]:  # decoder_start_token_id, pad_token_id: the model config's, else the generation config's
            value = getattr(backbone.config, key, None)
            if (value := getattr(backbone.generation_config, key, None) if value is None else value) is None:
                raise ValueError(f"{type(backbone).__name__}: config has no {key}")
            setattr(self, key, int(value))

        # Post-LN stacks (BART, LED, BERT) end each layer with a LayerNorm; pre-LN stacks (mBART, Pegasus) end the
        # whole stack with one (``layer_norm``) and their layers' ``final_layer_norm`` is the FFN's input norm.
        self.pre_layer_norm = isinstance(getattr(self._stack, "layer_norm", None), nn.Module)
        norms = [None if self.pre_layer_norm else output_layer_norm(layer) for layer in self._top_layers]
        self.__dict__["_adapter_norms"] = norms
        self.adapter_sets = nn.ModuleDict({path: AdapterSet(self.hidden_size, adapter, norms) for path in PATHS})
        self.load_adapter_state("global", self.adapter_state("local"))  # identical start: round 0 teacher = student
        self.adapter_sets["global"].requires_grad_(False)

        self._active: str | None = None
        # Post-LN layers: the adapter replaces the layer's output LayerNorm, reading that LayerNorm's input Z
        # (see pipeline/modeling/adapters.py); other layers: the adapter reads the layer's output.
        for i, (layer, norm) in enumerate(zip(self._top_layers, norms)):
            (norm or layer).register_forward_hook(functools.partial(self._adapter_hook, i, norm is not None))
        self.to(torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu"))
        self.train(False)

    @classmethod
    def from_pretrained(cls, path: str | Path, adapter: AdapterConfig, device=None) -> AdapterSummarizer:
        """An HF encoder-decoder (BART/LED/mBART/Pegasus, or an EncoderDecoderModel such as BERT2BERT) and its
        tokenizer from ``path`` (a local dir or a hub id)."""
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer  # lazy: ~1 s to import

        if Path(path).is_dir():
            check_model_dir(path)  # a damaged directory names its file instead of failing deep in transformers
        backbone = AutoModelForSeq2SeqLM.from_pretrained(str(path))  # EncoderDecoderModel too; stage backbone checks
        return cls(backbone, AutoTokenizer.from_pretrained(str(path)), adapter, device)

    @functools.cached_property
    def device(self) -> torch.device:
        """Where the adapters are (read per micro-batch: kept until :meth:`_apply`, not found by a parameter walk)."""
        return next(self.adapter_sets.parameters()).device

    def _apply(self, fn, recurse: bool = True):
        self.__dict__.pop("device", None)  # .to(), .cuda(), ...: found again
        return super()._apply(fn, recurse)

    def train(self, mode: bool = True) -> AdapterSummarizer:
        """The adapters' mode; the backbone stays in eval mode (frozen: no dropout, so the shared prefix is
        deterministic and cacheable), set once rather than walked on every call."""
        self.training = mode
        self.adapter_sets.train(mode)  # the only child besides the backbone
        if self.backbone.training:
            self.backbone.eval()
        return self

    def _adapter_hook(self, i: int, on_input: bool, module, args, output):
        if self._active is None:
            return output
        adapter = (self.adapter_sets[self._active] if isinstance(self._active, str) else self._active)[i]
        if on_input:  # Y = Z, the input of the layer's output LayerNorm
            return adapter(args[0])
        return (adapter(output[0]),) + tuple(output[1:]) if isinstance(output, tuple) else adapter(output)

    @contextlib.contextmanager
    def use_path(self, path: str | AdapterStack | None) -> Iterator[None]:
        """Activate adapter set ``path`` (one of PATHS; an AdapterStack: its runs' adapters on run-major rows; None =
        the bare backbone) for every forward inside the block."""
        previous = self._active
        object.__setattr__(self, "_active", path)  # a stack is a module: not registered as this one's child
        try:
            yield
        finally:
            object.__setattr__(self, "_active", previous)

    def adapter_state(self, path: str) -> dict[str, torch.Tensor]:
        """CPU float32 copies; keys (``layer{i}.down.weight`` ...) are the same for both paths."""
        return self.adapter_sets[path].state()

    def load_adapter_state(self, path: str, state: dict[str, torch.Tensor]) -> None:
        self.adapter_sets[path].load_state(state)

    def fresh_adapter_state(self, seed: int) -> dict[str, torch.Tensor]:
        """A newly initialised adapter set (as ``adapter_state`` returns it) from ``seed``: the round-0 weights."""
        config = dataclasses.replace(self.adapter_config, seed=seed)
        return AdapterSet(self.hidden_size, config, self._adapter_norms).state()

    def local_parameters(self) -> list[nn.Parameter]:
        return list(self.adapter_sets["local"].parameters())

    @functools.cached_property
    def backbone_fingerprint(self) -> str:
        """sha256 of the backbone's config, weights, attention implementation, library versions and tokenizer."""
        import transformers  # lazy: importing transformers takes ~0.5 s

        h = hashlib.sha256()
        h.update(self.backbone.config.to_json_string(use_diff=False).encode())
        h.update(f"torch={torch.__version__};transformers={transformers.__version__}".encode())
        led = "; global attention on the first token" if self.backbone.config.model_type == "led" else ""  # _source
        h.update(f"{getattr(self.backbone.config, '_attn_implementation', '')}{led}".encode())
        for name, tensor in sorted(self.backbone.state_dict().items()):
            h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            h.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        vocab = sorted(self.tokenizer.get_vocab().items())
        h.update(json.dumps([vocab, sorted(self.tokenizer.all_special_tokens)]).encode())
        return h.hexdigest()

    def forward_path(self, batch: Batch, path: str | None) -> torch.Tensor:
        """Plain full HF forward with ``path``'s adapters (the reference computation). Returns logits [B,T,V]."""
        with self.use_path(path):
            return self.backbone(
                **self._source(batch.input_ids, batch.attention_mask),
                decoder_input_ids=batch.decoder_input_ids.to(self.device),
                use_cache=False,
            ).logits

    def _source(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The encoder's inputs on the device; an LED's with global attention on its first token (HF's LED recipe)."""
        source = {"input_ids": input_ids.to(self.device), "attention_mask": (mask := attention_mask.to(self.device))}
        if self.backbone.config.model_type == "led":  # 1 at position 0, a source token (right padding)
            source["global_attention_mask"] = nn.functional.pad(mask[:, :1], (0, mask.shape[1] - 1))
        return source

    @torch.no_grad()
    def compute_prefix(self, batch: Batch) -> Prefix:
        """Run the encoder and decoder layers 0..L-k-1 once; capture what enters layer L-k, then stop."""
        captured: dict = {}

        def grab(module, args, kwargs):  # the layer's inputs by parameter name
            captured.update(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
            raise _PrefixReady

        with self._top_layers[0].register_forward_pre_hook(grab, with_kwargs=True), contextlib.suppress(_PrefixReady):
            self.forward_path(batch, None)
        if "hidden_states" not in captured:
            raise RuntimeError("the backbone forward never reached the first adapted decoder layer")
        return Prefix.of(batch, captured["encoder_hidden_states"], captured["hidden_states"])

    def top_masks(self, prefix: Prefix, source_mask: torch.Tensor | None = None):
        """The top layers' masks, from the builders the HF decoders call. A builder given a padding mask tests it in a
        Python ``if`` (on a GPU, a host sync), so the causal self-attention over right-padded targets gets none (their
        padding never reaches a valid token) and the cross-attention's is passed only where ``source_mask`` (the
        prefix's encoder mask on the host: the batch's; None: read from the prefix, a sync) has padding."""
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask  # lazy: ~1 s to import

        h, config = prefix.decoder_hidden, self._stack.config
        self_mask = create_causal_mask(config=config, inputs_embeds=h, attention_mask=None, past_key_values=None)
        padded = not bool((source_mask if source_mask is not None else prefix.encoder_mask).all())
        cross_mask = create_bidirectional_mask(
            config=config,
            inputs_embeds=h,
            attention_mask=prefix.encoder_mask.to(h.device) if padded else None,
            encoder_hidden_states=prefix.encoder_hidden,
            allow_is_bidirectional_skip=not padded,  # the builder's own test: no mask without padding
        )
        return self_mask, cross_mask

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        if self.pre_layer_norm:  # mBART / Pegasus decoders end with a LayerNorm
            h = self._stack.layer_norm(h)
        owner = self._head_owner
        if hasattr(owner, "cls"):  # BertLMHeadModel
            return owner.cls(h)
        logits = owner.lm_head(h)
        bias = getattr(owner, "final_logits_bias", None)
        return logits + bias.to(logits.device) if bias is not None else logits

    def path_logits(
        self, prefix: Prefix, path: str | AdapterStack, masks, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Top k layers with ``path``'s adapters under ``masks`` (:meth:`top_masks`'s) + LM head on a prefix. The LM
        head (n x V, the dominant cost) runs only on the prefix's target tokens: [B, T, V] with 0 elsewhere, or with
        ``labels`` (the prefix's [B, T] on the host) the packed rows of its real target tokens (row-major), with no
        host sync (their indices are read on the host)."""
        self_mask, cross_mask = masks
        h = prefix.decoder_hidden
        with self.use_path(path):
            for layer in self._top_layers:
                h = layer(h, self_mask, prefix.encoder_hidden, encoder_attention_mask=cross_mask)
                h = h[0] if isinstance(h, tuple) else h
        if labels is not None:
            rows = (labels != IGNORE_INDEX).flatten().nonzero().squeeze(1).to(h.device, non_blocking=True)
            return self._head(h.reshape(-1, h.shape[-1]).index_select(0, rows))
        mask = prefix.target_mask.to(h.device, torch.bool)
        if bool(mask.all()):
            return self._head(h)
        out = self._head(h[mask])  # a differentiable scatter into zeros
        return out.new_zeros(*mask.shape, out.shape[-1]).index_put((mask,), out)

    def forward_two_paths(
        self, batch: Batch, prefix: Prefix | None = None, packed: bool = False, teacher: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Both paths' logits from one prefix: (local, with gradients; global, the teacher, under no_grad; None
        without ``teacher``), each [B, T, V] (0 on padding), or with ``packed`` the [N, V] rows of the real target
        tokens (row-major)."""
        prefix = prefix if prefix is not None else self.compute_prefix(batch)
        masks = self.top_masks(prefix, batch.attention_mask)
        labels = batch.labels if packed else None
        logits_local = self.path_logits(prefix, "local", masks, labels)
        with torch.no_grad():
            return logits_local, self.path_logits(prefix, "global", masks, labels) if teacher else None

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, path: str | None = "local", **generation_kwargs) -> torch.Tensor:
        """HF ``generate`` with ``path``'s adapters active."""
        with self.use_path(path):
            return self.backbone.generate(**self._source(input_ids, attention_mask), **generation_kwargs)
