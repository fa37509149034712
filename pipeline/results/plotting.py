"""What every figure of the results shares: matplotlib without a display (Agg), :func:`save` (every figure
module saves through it) and :func:`slug` (a name in a figure's or its data's file name)."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pipeline.common import atomic  # noqa: E402


def save(fig, path: Path) -> Path:
    """Lay out, write (atomically, 120 dpi; its folder created) and close a figure."""
    fig.tight_layout()
    atomic.savefig(fig, path, dpi=120)
    plt.close(fig)
    return path


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text).strip("_")
