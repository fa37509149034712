"""What each role of a real federation holds (docs/federation.md): the server's kit (plan, backbone, its run
config) and a site's (plus its own examples, partition and POS tags only), laid out as the project root.
The plan and data readers are imported inside the functions: `python -m pipeline.federation status` starts without
torch."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from pipeline.common import atomic
from pipeline.common.config import from_dict
from pipeline.common.schema import DataError

RUN_CONFIG = "run_config.toml"  # the server's kit: the ServerApp's run config


def write_kit(plan_path: str, out: Path, client: str | None = None, params: str = "params.yaml") -> list[Path]:
    """Copy what the server (``client`` None; its run config from the ``params`` file) or ``client``'s site holds
    (docs/federation.md) into ``out``, laid out as the project root; returns the paths written (relative to ``out``).
    The plan keeps its relative path, so the same run config works on every role."""
    from pipeline.experiments.plans import read_plan
    from pipeline.training.client_data import read_examples, read_partition

    plan = read_plan(plan_path)
    if not plan.clients:
        raise DataError(
            f"{plan_path}: the plan declares no clients (not a federated plan, or written before plans "
            f"declared them: rerun the plan stage)"
        )
    if client is not None and client not in plan.clients:
        raise DataError(f"{plan_path}: no client {client!r} (clients: {plan.clients})")
    run_config = {"plan": plan_path, **server_run_config(params, plan.experiment)} if client is None else None
    (out / plan_path).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plan_path, out / plan_path)
    backbone = Path(plan.paths["backbone"])
    if not backbone.is_dir():
        raise FileNotFoundError(f"{backbone}: backbone not found (stage `backbone`)")
    shutil.copytree(backbone, out / backbone, dirs_exist_ok=True)
    written = [Path(plan_path), backbone]
    if run_config is not None:
        # JSON's strings, numbers and booleans are TOML's too
        atomic.write_text(out / RUN_CONFIG, "".join(f"{k} = {json.dumps(v)}\n" for k, v in run_config.items()))
        return [*written, Path(RUN_CONFIG)]

    part_path = Path(plan.paths["partition"])
    splits = (partition := read_partition(part_path))["clients"][client]
    ids = {str(i) for split in splits.values() for i in split}
    # only this client's ids: the other sites' example ids and the excluded ids stay with the data owner
    part = {k: partition[k] for k in ("scheme", "seed", "params") if k in partition} | {"clients": {client: splits}}
    own = [Path(plan.paths["examples"]), *([Path(plan.paths["postags"])] if "postags" in plan.paths else [])]
    atomic.write_text(out / part_path, json.dumps(part, indent=1))
    examples = read_examples(own[0])
    atomic.to_parquet(
        examples[examples["example_id"].astype(str).isin(ids)].reset_index(drop=True), out / own[0], index=False
    )
    if len(own) > 1:
        import pandas as pd

        tags = pd.read_parquet(own[1])
        atomic.to_parquet(tags[tags["example_id"].astype(str).isin(ids)], out / own[1], index=False)
    return [*written, part_path, *own]


def server_run_config(params_file: str, experiment: str) -> dict[str, str | float]:
    """The ServerApp's run-time settings from a params file: round and admission timeouts (with ``experiment``'s
    overrides) and the federated evaluation's decoding (its ``evaluate`` group, as JSON)."""
    from pipeline.common.config import load_params
    from pipeline.experiments.settings import load_run_settings
    from pipeline.results.evaluation import EvaluateConfig

    settings = load_run_settings(params_file, experiment)  # a missing file is an error, never the defaults
    decoding = from_dict(EvaluateConfig, load_params(params_file).get("evaluate"), f"{params_file}: evaluate")
    return {
        "round-timeout-s": settings.round_timeout_s,
        "admission-timeout-s": settings.admission_timeout_s,
        "decoding": json.dumps(dataclasses.asdict(decoding)),
    }
