"""What every figure of the results shares: matplotlib without a display (Agg) and :func:`save` (every figure
module saves through it)."""

from __future__ import annotations

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
