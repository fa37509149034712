"""Run profiles: partial params.yaml files in ``configs/`` applied through DVC's own parameter mechanism.

A preset has params.yaml's nested layout and names only keys params.yaml has (an unknown key is an error). Applying
it runs ``dvc exp run --set-param key=value ...``, one override per leaf, so every profile run is a DVC experiment.
Leaves (lists included) replace the params.yaml value, mappings merge key by key, and ``experiments`` is replaced
whole (``~experiments`` then ``+experiments={...}``), each entry checked as the plan stage checks it. A grid is
DVC's own sweep (``make grid``); docs/experiments.md has the recipes.

    python -m pipeline.presets show configs/cpu-study.yaml          # the flattened overrides
    python -m pipeline.presets check configs/*.yaml                  # validate only
    python -m pipeline.presets run configs/cpu-study.yaml [--name N] [--queue | --temp] [--parts KEY] [--dry-run]
    python -m pipeline.presets export NAME DEST [PATH | SRC=TARGET ...]  # a finished experiment's files, at its commit
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from pipeline.common import atomic, cli
from pipeline.common.config import ConfigError, flatten, load_params

# Groups a preset replaces as a whole instead of merging into (see module docstring).
REPLACED_WHOLE = ("experiments",)


class PresetError(ValueError):
    """A preset names unknown keys or has the wrong shape; the message names the file and every bad key."""


def load_preset(path: str | Path, params_file: str | Path | None = None) -> dict[str, Any]:
    """The preset file ``path``; with ``params_file`` (read first: a bad one is named before the preset), checked
    against it (every :func:`problems`, one error)."""
    params = load_params(params_file) if params_file is not None else None
    if not Path(path).is_file():
        raise PresetError(f"{path}: preset file not found")
    try:  # read as params.yaml is: not YAML (a duplicate key, not UTF-8) or not a mapping, one line naming it
        data = load_params(path)
    except ConfigError as e:
        raise PresetError(str(e)) from None
    if not data:
        raise PresetError(f"{path}: a preset must be a non-empty mapping with params.yaml's nested layout")
    if params is not None and (bad := problems(data, params, str(params_file))):
        raise PresetError(f"{path}: {len(bad)} problem(s): " + "; ".join(bad))
    return data


def _set_params(params: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``params`` with ``overrides`` applied by DVC's own ``--set-param`` (Hydra overrides on OmegaConf in struct
    mode: a key params.yaml lacks raises DVC's InvalidArgumentError)."""
    from dvc.utils.hydra import apply_overrides  # lazy: `show` starts without DVC (~0.03 s more)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "params.yaml"
        atomic.write_text(path, yaml.safe_dump(params, sort_keys=False))
        apply_overrides(str(path), overrides)
        return load_params(path)


def apply_preset(params: dict[str, Any], preset: dict[str, Any]) -> dict[str, Any]:
    """params.yaml with the preset applied: what ``dvc exp run -S ...`` leaves in the workspace."""
    return _set_params(params, overrides(preset))


def problems(preset: dict[str, Any], params: dict[str, Any], file: str = "params.yaml") -> list[str]:
    """Every problem of ``preset`` against ``params`` (read from ``file``, which the problems name; empty = valid):
    each override Hydra refuses (one by one, so every unknown key is named), else what the plan stage refuses of
    each experiment entry (its partition one the partition stage produces among them)."""
    from dvc.exceptions import InvalidArgumentError  # lazy: `show` starts without DVC

    from pipeline.planning import check_params  # lazy: the other commands start without torch
    from pipeline.privacy.accounting import check_client_plans  # lazy, as planning

    groups = {key.rsplit(".", n)[0] for key in flatten(params) for n in range(1, key.count(".") + 1)}
    found = [  # YAML null (every key commented out) would replace params.yaml's group whole: its defaults planned
        f"{key}: null where {file} has a mapping (every key commented out?); name its keys or leave it out"
        for key, value in flatten(preset, whole=REPLACED_WHOLE).items()
        if value is None and key in groups
    ]
    try:
        applied = apply_preset(params, preset)
    except InvalidArgumentError:
        for override in overrides(preset):
            try:
                _set_params(params, [override])
            except InvalidArgumentError as exc:  # Hydra's refusal, as one line naming the key
                key, causes = override.lstrip("~+").partition("=")[0], []
                while exc is not None:
                    causes.append(" ".join(str(exc).split()))
                    exc = exc.__cause__
                unknown = any("not in struct" in c for c in causes)
                found.append(f"{key}: unknown key ({file} has no {key})" if unknown else f"{key}: {causes[-1]}")
        return found
    entries = applied.get("experiments")  # the preset's, else params.yaml's
    alone = [{name: entry} for name, entry in entries.items()] if isinstance(entries, dict) else []
    for each in alone or [entries]:  # each entry alone, as the plan stage checks it: every bad one is named
        try:
            check_client_plans(check_params(applied | {"experiments": each}, file), file)  # the plan stage's refusals
        except ValueError as e:  # ConfigError among them
            found.append(str(e))
    return list(dict.fromkeys(found))  # a group the preset broke fails every entry alike: named once


def hydra_value(value: Any) -> str:
    """A value in Hydra's override grammar (what ``dvc exp run -S`` parses), by Hydra's own writer; strings quoted."""
    from hydra.core.override_parser.types import Override, Quote, QuotedString  # lazy: importing Hydra takes ~0.1 s

    def quoted(v: Any) -> Any:
        if isinstance(v, str):
            return QuotedString(text=v, quote=Quote.single)
        if isinstance(v, (list, tuple)):
            return [quoted(x) for x in v]
        if isinstance(v, dict):
            return {k: quoted(x) for k, x in v.items()}
        if v is None or isinstance(v, (bool, int, float)):
            return v
        raise PresetError(f"value {v!r}: unsupported type {type(v).__name__}")

    return Override._get_value_element_as_str(quoted(value), space_after_sep=True)


def overrides(preset: dict[str, Any]) -> list[str]:
    """The ``--set-param`` overrides for ``dvc exp run``, one per leaf key, in file order."""
    out: list[str] = []
    for key, value in flatten(preset, whole=REPLACED_WHOLE).items():
        value = hydra_value(value)
        out += [f"~{key}", f"+{key}={value}"] if key in REPLACED_WHOLE else [f"{key}={value}"]
    return out


def run_commands(
    preset_path: Path, params_file: str | Path, name: str | None, by: str | None = None, flags: tuple[str, ...] = ()
) -> list[list[str]]:
    """The ``dvc exp run`` commands (with ``flags``: ``--queue``, ``--temp``) that apply the preset, validated against
    ``params_file`` (params.yaml, which DVC applies it to) first: each entry alone, so each part is valid too. With
    ``by``, a long preset as several DVC experiments: one per value of the experiments' ``by`` key (e.g. ``seed``),
    named ``<name>-<by><value>``, each with only those experiments, then the whole preset as ``<name>``, which
    trains nothing again: its train and evaluate stages are the parts', restored from DVC's run cache."""
    preset = load_preset(preset_path, params_file)
    parts = {}
    if by is not None:
        if not (entries := preset.get("experiments")):
            raise PresetError(f"{preset_path}: --parts needs the preset's own `experiments`")
        from pipeline.planning import ENTRY_KEYS  # lazy: the other commands start without torch

        if by not in ENTRY_KEYS:
            raise PresetError(f"--parts {by!r}: split by one of the experiments' keys {list(ENTRY_KEYS)}")
        groups: dict[str, dict[str, Any]] = {}
        for exp, entry in entries.items():
            if (value := (entry or {}).get(by)) is None:
                raise PresetError(f"{preset_path}: experiments.{exp} sets no {by!r}; every entry needs it for --parts")
            groups.setdefault(re.sub(r"[^\w-]", "-", str(value)), {})[exp] = entry
        if len(groups) < 2:
            raise PresetError(f"{preset_path}: every experiment has the same {by!r}; nothing to split")
        parts = {f"{name}-{by}{value}": {**preset, "experiments": group} for value, group in groups.items()}
    commands = []
    for part_name, part in (parts | {name: preset}).items():
        named = ["--name", part_name] if part_name else []
        overridden = [arg for ov in overrides(part) for arg in ("--set-param", ov)]
        commands.append([sys.executable, "-m", "dvc", "exp", "run", *named, *flags, *overridden])
    return commands


def export_experiment(name: str, dest: str | Path, paths: list[str]) -> list[str]:
    """Copy the experiment's params.yaml, dvc.lock and ``paths`` (globs allowed; ``SRC=TARGET`` renames) into
    ``dest`` and write ``dest/EXPERIMENT.yaml`` naming the experiment, its commit and what was copied. Returns the
    files written, relative to ``dest``. A path the experiment does not have is an error naming it."""
    from dvc.api import DVCFileSystem  # lazy: importing dvc.api takes ~0.2-0.4 s

    # the newest DVC experiment called ``name`` (DVC keeps it as a git ref under refs/exps)
    command = ["git", "for-each-ref", "--sort=-committerdate", "--format=%(objectname) %(refname)", "refs/exps/"]
    listed = subprocess.run(command, capture_output=True, text=True, check=True).stdout.split("\n")
    if not (found := [line.split(" ", 1) for line in listed if line.endswith("/" + name)]):
        raise PresetError(f"no DVC experiment named {name!r} in {Path.cwd()} (see `dvc exp list --all-commits`)")
    commit, ref = found[0]
    fs, dest, written = DVCFileSystem(".", rev=commit), Path(dest), []
    for spec in ["params.yaml", "dvc.lock", *paths]:
        src, _, target = spec.partition("=")
        matches = sorted(fs.glob(src)) if any(c in src for c in "*?[") else [src] if fs.exists(src) else []
        if not matches:
            raise PresetError(f"experiment {name!r} ({commit[:7]}) has no {src!r}")
        for match in matches:
            match = match.lstrip("/")
            # a renamed path goes to TARGET; each match of a glob keeps its path, under TARGET when given
            out = dest / target / match if target and match != src else dest / (target or match)
            is_dir = fs.isdir(match)
            for f in [f.lstrip("/") for f in fs.find(match)] if is_dir else [match]:
                to = out / Path(f).relative_to(match) if is_dir else out
                with atomic.replacing(to) as tmp:
                    fs.get_file(f, str(tmp))
                written.append(str(to.relative_to(dest)))
    record = {
        "experiment": name,
        "ref": ref,
        "commit": commit,
        "exported_with": "python -m pipeline.presets export " + shlex.join([name, str(dest), *paths]),
        "files": sorted(written),
    }
    atomic.write_text(dest / "EXPERIMENT.yaml", yaml.safe_dump(record, sort_keys=False))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_params(ap, "the params.yaml presets are checked against")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("show", help="validate and print the flattened overrides").add_argument("preset")
    sub.add_parser("check", help="validate one or more presets").add_argument("presets", nargs="+")
    run = sub.add_parser("run", help="validate, then `dvc exp run --set-param ...` (a DVC experiment)")
    run.add_argument("preset", type=Path)
    run.add_argument("--name", help="experiment name (dvc exp run --name)")
    where = run.add_mutually_exclusive_group()
    where.add_argument("--queue", action="store_true", help="queue instead of running (dvc queue start runs it)")
    where.add_argument("--temp", action="store_true", help="run in a temporary copy (dvc exp run --temp)")
    run.add_argument(
        "--parts",
        metavar="KEY",
        help="one DVC experiment per value of the experiments' KEY (e.g. seed), then the whole (needs --name)",
    )
    run.add_argument("--dry-run", action="store_true", help="print the dvc command only")
    export = sub.add_parser(
        "export",
        help="copy a finished experiment's params, dvc.lock and named outputs into "
        "a folder (read at its commit; the workspace is left as it is)",
    )
    export.add_argument("experiment", help="the experiment's name (dvc exp list --all-commits)")
    export.add_argument("dest", help="folder to write into (e.g. reports/privacy/study)")
    export.add_argument("paths", nargs="*", help="its outputs or git files; globs allowed; SRC=TARGET renames")
    args = ap.parse_args(argv)
    if args.command == "export":
        written = export_experiment(args.experiment, args.dest, args.paths)
        print(f"{args.dest}: {len(written)} files of experiment {args.experiment!r} (EXPERIMENT.yaml names them)")
        return 0
    if args.command in ("show", "check"):
        for path in [args.preset] if args.command == "show" else args.presets:
            found = overrides(load_preset(path, args.params))
            print("\n".join(found) if args.command == "show" else f"{path}: ok ({len(found)} overrides)")
        return 0
    if args.parts and not args.name:
        raise PresetError("--parts needs --name (the parts are named <name>-<key><value>)")
    flags = tuple(flag for flag in ("--queue", "--temp") if getattr(args, flag[2:]))
    for cmd in run_commands(args.preset, args.params, args.name, args.parts, flags):
        print(shlex.join(cmd), flush=True)
        if not args.dry_run and (status := subprocess.call(cmd)) != 0:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
