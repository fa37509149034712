"""A finished run's outputs move from its run directory (pipeline.training.checkpoints) to ``models/<exp>/``."""
from __future__ import annotations

from pathlib import Path

from pipeline.common import atomic
from pipeline.experiments import Plan


def publish_outputs(plan: Plan) -> Path:
    """Copy a finished run's outputs from its run directory into ``models/<exp>/``, replacing what was there as a
    whole; returns that directory. The caller removes the run directory: a kill before that publishes again."""
    import shutil

    source, target = Path(plan.paths["out_dir"]), Path(plan.paths["model_dir"])

    def run_only(directory: str, names: list[str]) -> set[str]:
        # the checkpoints, and the clients' per-round gate log parts (merged into gate_log.parquet by now)
        here = Path(directory)
        if here == source:
            return {"checkpoint"} & set(names)
        return {"gate_log"} & set(names) if here.parent == source / "clients" else set()

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = atomic.temp_dir_for(target)
    shutil.copytree(source, tmp, ignore=run_only, dirs_exist_ok=True)
    atomic.replace_dir(tmp, target)
    return target
