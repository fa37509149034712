"""One entry point for every stage CLI: an error that is the user's to fix ends in one line ``error: <message>``
and exit status 2, as argparse does for a bad command line (docs/data.md, Reliability); any other keeps its traceback.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys
from collections.abc import Callable
from typing import Any

from pipeline.common.config import ConfigError, from_dict, load_params
from pipeline.common.schema import DataError

EXIT_USAGE = 2
# Defined in stage modules that may run as ``__main__`` (so matched by name, not by identity).
STAGE_ERRORS = ("BackboneError", "PresetError", "FederationError")


def freeze_collected() -> None:
    """No full collection scans this process's objects so far (its imports' ~500k) again, nor at exit what its work
    made (~1 s CPU a stage or Flower message; docs/performance.md); the collector stays on for the work."""
    gc.freeze()
    gc.enable()
    atexit.register(gc.freeze)


def run(main: Callable[..., Any], argv: list[str] | None = None) -> int:
    """Run a stage's ``main(argv)`` and return the process exit status."""
    if argv is None:  # this process is the stage
        freeze_collected()
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("FEDMEET_DEBUG", "") not in ("", "0")
    try:
        status = main([a for a in args if a != "--debug"])
    except Exception as exc:  # noqa: BLE001 -- narrowed just below, the rest is re-raised
        # A missing input (an upstream stage not run yet, a wrong path) is the user's to fix too; its message names
        # the file.
        user = isinstance(exc, (DataError, ConfigError, FileNotFoundError)) or any(
            c.__name__ in STAGE_ERRORS for c in type(exc).__mro__
        )
        if debug or not user:
            raise
        text = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, FileNotFoundError) and exc.filename is not None:  # "[Errno 2] No such file ...: 'x'"
            text = f"{exc.filename}: not found"
        elif isinstance(exc, FileNotFoundError) and ":" not in text:  # pyarrow and friends give the bare path
            text = f"{text}: not found"
        print(f"error: {text}", file=sys.stderr)
        return EXIT_USAGE
    return int(status or 0)


def add_params(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """A stage's ``--params``: the params file it reads (a study's or a site's, not always ./params.yaml)."""
    parser.add_argument("--params", default="params.yaml", help=help)


def read_params(file: str, /, **groups: type) -> tuple[Any, ...]:
    """The params of ``file`` (``--params``), then the config of each of ``groups`` (group name: config class); a bad
    value is one line naming the file and the key: ``<file> <group>.<key>``."""
    params = load_params(file)
    return params, *(from_dict(cls, params.get(name), f"{file} {name}") for name, cls in groups.items())
