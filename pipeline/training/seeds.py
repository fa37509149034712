"""Seeds derived from the experiment seed: every random draw of a run is a function of (seed, client, round, ...),
so a run is reproducible in any process and a resumed run draws what the uninterrupted one would have."""

from __future__ import annotations

import zlib
from typing import Any


def derived_seed(*parts: Any) -> int:
    """A stable 31-bit seed from (experiment seed, client, round, ...): same inputs, same seed, any process."""
    return zlib.crc32("/".join(str(p) for p in parts).encode()) & 0x7FFFFFFF
