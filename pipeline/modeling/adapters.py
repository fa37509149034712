"""Houlsby bottleneck adapters on the top decoder layers (METHOD.md section 3; W_down: n x m, W_up: m x n), and
their files. Where Y is read: docs/ARCHITECTURE.md, Model (on post-LN layers the adapter's LayerNorm replaces the
layer's, as in Houlsby et al. 2019, because a second LayerNorm on top cannot be the identity: measured on MiniLM,
17-118 % relative change). W_down ~ N(0, init_std^2), so W_up (zero at round 0) gets a gradient at once."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn

from pipeline.common import atomic
from pipeline.common.config import PositiveInt, config
from pipeline.common.schema import DataError


@config
class AdapterConfig:
    top_k: PositiveInt  # adapters after the top k decoder layers
    bottleneck: PositiveInt  # m (the paper: 2n, e.g. 1536 for BART-base)
    bias: bool = True  # biases on W_down and W_up (our default; the paper's equation has none)
    init_std: float = 0.02  # std of the W_down init (BERT/BART initializer_range)
    # W_down init: from a generator seeded with ``seed`` (same seed, same adapters, whatever ran before), or from
    # torch's global RNG when None (seed it yourself)
    seed: int | None = None


class HoulsbyAdapter(nn.Module):
    """``Y_hat = LayerNorm(Y + ReLU(Y W_down) W_up)`` applied position-wise to a layer output ``Y``."""

    def __init__(self, hidden: int, bottleneck: int, bias: bool = True, eps: float = 1e-5):
        super().__init__()
        self.down = nn.Linear(hidden, bottleneck, bias=bias)  # W_down
        self.up = nn.Linear(bottleneck, hidden, bias=bias)  # W_up
        self.norm = nn.LayerNorm(hidden, eps=eps)

    def reset_parameters(
        self, init_std: float, layer_norm: nn.LayerNorm | None = None, generator: torch.Generator | None = None
    ) -> None:
        with torch.no_grad():
            nn.init.normal_(self.down.weight, std=init_std, generator=generator)
            nn.init.zeros_(self.up.weight)
            if self.down.bias is not None:
                nn.init.zeros_(self.down.bias)
                nn.init.zeros_(self.up.bias)
            if layer_norm is not None and layer_norm.weight is not None:
                self.norm.load_state_dict(layer_norm.state_dict())  # its weight and bias
                self.norm.eps = layer_norm.eps
            else:
                self.norm.reset_parameters()  # weight 1, bias 0

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.norm(y + self.up(torch.relu(self.down(y))))


def output_layer_norm(layer: nn.Module) -> nn.LayerNorm | None:
    """The LayerNorm that produces a post-LN decoder layer's output (None for pre-LN or unknown layers)."""
    modules = dict(layer.named_modules())
    for name in ("final_layer_norm", "output.LayerNorm"):  # BART/mBART/Pegasus/LED, BERT/RoBERTa
        if isinstance(modules.get(name), nn.LayerNorm):
            return modules[name]
    return None


class AdapterSet(nn.ModuleList):
    """One adapter per adapted layer (``[i]``); ``state()`` names are ``layer{i}.down.weight`` etc. with i = 0..k-1
    counted from the lowest adapted layer, so the global and the local set have identical key names."""

    def __init__(self, hidden: int, config: AdapterConfig, layer_norms: list[nn.LayerNorm | None]):
        super().__init__(HoulsbyAdapter(hidden, config.bottleneck, config.bias) for _ in range(config.top_k))
        generator = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
        for adapter, ln in zip(self, layer_norms):
            adapter.reset_parameters(config.init_std, ln, generator)

    def leaves(self) -> dict[str, nn.Parameter]:
        """The parameters by their ``state()`` key, where they are (no copy)."""
        return {f"layer{name}": p for name, p in self.named_parameters()}

    def state(self) -> dict[str, torch.Tensor]:
        return {key: p.detach().to("cpu", torch.float32, copy=True) for key, p in self.leaves().items()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        own = self.leaves()
        missing, unknown = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unknown:
            raise ValueError(f"adapter state does not match: missing {missing[:4]}, unknown {unknown[:4]}")
        with torch.no_grad():
            for key, p in own.items():
                value = torch.as_tensor(state[key])
                if value.shape != p.shape:
                    raise ValueError(f"adapter state {key}: shape {tuple(value.shape)} != expected {tuple(p.shape)}")
                p.copy_(value.to(p.device, p.dtype))


def adapter_file(client_dir: Path, which: str) -> Path:
    """A client's ``best`` (lowest validation loss so far) or ``final`` (last round) adapter in its output directory."""
    return Path(client_dir) / f"adapter_{which}.safetensors"


def save_adapter(path: str | Path, state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    # serialized here and written as any file, not by save_file, which creates its file mode 0600 whatever the umask;
    # the header re-written with sorted keys: safetensors orders metadata as a hash map does, so equal tensors would
    # give files (and DVC hashes) whose bytes differ from run to run
    data = save({k: v.detach().cpu().contiguous() for k, v in state.items()}, metadata=metadata)
    end = 8 + int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8:end]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the tensor data stays 8-byte aligned
    atomic.write_bytes(path, len(header).to_bytes(8, "little") + header + data[end:])


def load_adapter(path: str | Path) -> dict[str, torch.Tensor]:
    """An adapter file's weights; a missing or damaged file is one clear error."""
    if not Path(path).is_file():
        raise DataError(f"{path}: adapter weights not found (did the train stage finish for this client?)")
    try:
        return load_file(str(path))
    except SafetensorError as err:  # cut short, a broken header: safetensors' message names no file
        raise DataError(f"{path}: not a readable adapter file ({err})") from None
