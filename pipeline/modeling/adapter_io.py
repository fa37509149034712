"""Adapter files (safetensors): what training writes per client (``clients/<client>/adapter_{best,final}``,
round checkpoints, the deployed server's global adapter) and what evaluation loads back."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.common import atomic
from pipeline.common.schema import DataError

if TYPE_CHECKING:
    import torch

def adapter_file(client_dir: Path, which: str) -> Path:
    """A client's ``best`` (lowest validation loss so far) or ``final`` (last round) adapter in its output directory."""
    return Path(client_dir) / f"adapter_{which}.safetensors"


def client_adapter_path(model_dir: Path, client: str, which: str) -> Path:
    """The same below an experiment's output directory (``models/<exp>/clients/<client>/``)."""
    return adapter_file(model_dir / "clients" / client, which)


def save_adapter(path: str | Path, state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    atomic.save_safetensors({k: v.detach().cpu().contiguous() for k, v in state.items()}, path, metadata)


def load_adapter(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def load_local_adapter(model, path: Path) -> None:
    """Load a trained client adapter file into ``model``'s local adapter set (what generation uses)."""
    if not path.is_file():
        raise DataError(f"{path}: adapter weights not found (did the train stage finish for this client?)")
    model.load_adapter_state("local", load_adapter(path))
