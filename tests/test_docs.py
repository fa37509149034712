"""The docs stay true: ARCHITECTURE.md's module map names every module, and every command in README/docs exists."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipeline"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _map_block() -> str:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Module map", 1)[1]
    return section.split("```", 2)[1]


def _map_sections() -> dict[str, str]:
    """Map text per package: '' for the top level, 'common' for the `  common/` entry and its continuation lines."""
    sections: dict[str, list[str]] = {"": []}
    current = ""
    for line in _map_block().splitlines()[1:]:
        head = re.match(r"^  ([a-z_]+)/\s", line)
        if head:
            current = head.group(1)
            sections[current] = []
        sections[current].append(line)
    return {name: "\n".join(lines) for name, lines in sections.items()}


def _strip_parentheses(text: str) -> str:
    previous = None
    while previous != text:
        previous, text = text, re.sub(r"\([^()]*\)", "", text)
    return text


def _parenthesised(text: str, start: int) -> str:
    depth = 1
    for end in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            return text[start:end]
    return text[start:]


def _modules() -> dict[str, set[str]]:
    """Package -> names under it (module stems and subpackage/sub-subpackage names), __init__ excluded."""
    found: dict[str, set[str]] = {"": set()}
    for path in PIPELINE.rglob("*.py"):
        rel = path.relative_to(PIPELINE)
        if path.name == "__init__.py" or "__pycache__" in rel.parts:
            continue
        if len(rel.parts) == 1:
            found[""].add(path.stem)
            continue
        names = found.setdefault(rel.parts[0], set())
        names.update(rel.parts[1:-1])
        names.add(path.stem)
    return found


def test_every_module_is_in_the_map():
    sections = _map_sections()
    missing = []
    for package, names in _modules().items():
        text = sections.get(package)
        if text is None:
            missing.append(f"{package}/ (the whole package)")
            continue
        for name in names:
            pattern = rf"\b{name}\.py\b" if package == "" else rf"(?<![\w.]){name}\b"
            if not re.search(pattern, text):
                missing.append(f"{package}/{name}" if package else f"{name}.py")
    assert not missing, f"modules absent from docs/ARCHITECTURE.md's module map: {sorted(missing)}"


def test_every_module_in_the_map_exists():
    modules = _modules()
    stale = []
    for package, text in _map_sections().items():
        if package == "":
            stale += [f"{m}.py" for m in re.findall(r"\b(\w+)\.py\b", text) if m not in modules[""]]
            continue
        if package not in modules:
            stale.append(f"{package}/")
            continue
        # the listed names are the bare identifiers between separators once explanations in parentheses are gone;
        # a subpackage's parentheses list its modules, so they are read the same way
        text = " ".join(text.replace(f"{package}/", "", 1).split())
        bodies = [_strip_parentheses(text)] + [
            _strip_parentheses(_parenthesised(text, m.end())) for m in re.finditer(r"\w+/ \(", text)
        ]
        for chunk in re.split(r"[,;:]|\band\b", " , ".join(bodies)):
            chunk = chunk.strip().rstrip("/").removeprefix("+ ").strip()
            if re.fullmatch(r"[a-z][a-z0-9_]*", chunk) and chunk not in modules[package]:
                stale.append(f"{package}/{chunk}")
    assert not stale, f"names in docs/ARCHITECTURE.md's module map that are not modules: {sorted(stale)}"


def _commands() -> list[tuple[str, str]]:
    """(file, command) for every command line in a shell code block of README.md and docs/*.md."""
    found = []
    for doc in DOCS:
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", doc.read_text(), re.S):
            lines = block.replace("\\\n", " ").splitlines()
            for line in lines:
                line = line.split(" #", 1)[0].strip()
                for command in re.split(r"\s*&&\s*|;\s*(?:do|then|done)\b\s*", line):  # a loop's body too
                    if re.match(r"(python|make|dvc|flwr|bash tools/)\b", command):
                        found.append((doc.name, command))
    return found


def _main_of(module: str):
    imported = importlib.import_module(module)
    if hasattr(imported, "main"):
        return imported.main
    source = (PIPELINE.parent / module.replace(".", "/") / "__main__.py").read_text()
    return importlib.import_module(re.search(r"from (\S+) import main", source).group(1)).main


def _help(main, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0, f"{argv} --help exited {exited.value.code}"
    return out.getvalue()


def _flags(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("--")]


def test_the_docs_have_commands():
    # the extraction below must keep finding the documented commands, else the checks pass on nothing
    kinds = {command.split()[0] for _, command in _commands()}
    assert {"python", "make", "dvc", "flwr"} <= kinds
    loop = "python -m pipeline.federation kit --plan $PLAN --client $c --out $SITES/$c"  # in a for ...; do ...; done
    assert ("federation.md", loop) in _commands()


def test_every_pipeline_command_exists():
    wrong = []
    for doc, command in _commands():
        tokens = shlex.split(command, comments=True) if "'" not in command else command.split()
        if tokens[:2] != ["python", "-m"] or not tokens[2].startswith(("pipeline.", "tools.")):
            continue
        main = _main_of(tokens[2])
        args = tokens[3:]
        text = _help(main, [])
        choices = re.search(r"\{([\w,-]+)\}", text)
        if choices and args and args[0] in choices.group(1).split(","):
            text = _help(main, [args[0]])
        elif choices and args and not args[0].startswith("-"):
            wrong.append(f"{doc}: {command}: no subcommand {args[0]!r}")
            continue
        wrong += [f"{doc}: {command}: no flag {f}" for f in _flags(args) if not re.search(rf"{f}\b", text)]
    assert not wrong, "\n".join(wrong)


def test_every_make_target_and_tool_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    wrong = []
    for doc, command in _commands():
        tokens = command.split()
        if tokens[0] == "make":
            wrong += [f"{doc}: {command}" for t in tokens[1:] if "=" not in t and t not in targets]
        elif tokens[0] in ("python", "bash") and tokens[1].startswith("tools/"):
            script = ROOT / tokens[1]
            if not script.is_file():
                wrong.append(f"{doc}: {command}: no {tokens[1]}")
            elif len(tokens) > 2 and not tokens[2].startswith(("-", ".", "/")) and tokens[2] not in script.read_text():
                wrong.append(f"{doc}: {command}: {tokens[1]} has no {tokens[2]!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.tools
@pytest.mark.parametrize("tool", ["dvc", "flwr"])
def test_every_dvc_and_flwr_command_exists_in_the_pinned_version(tool):
    executable = Path(sys.executable).parent / tool
    wrong = []
    for doc, command in _commands():
        tokens = command.replace("'", " ").split()
        if tokens[0] != tool:
            continue
        words = [t for t in tokens[1:3] if re.fullmatch(r"[a-z-]+", t)]
        while words:
            result = subprocess.run([executable, *words, "--help"], capture_output=True, text=True, timeout=120)
            if result.returncode == 0:
                break
            words.pop()
        if not words:
            wrong.append(f"{doc}: {command}: no subcommand")
            continue
        wrong += [f"{doc}: {command}: no flag {f}" for f in _flags(tokens) if not re.search(rf"{f}\b", result.stdout)]
    assert not wrong, "\n".join(wrong)


def test_the_readmes_repro_time_and_memory_are_the_committed_timing_tables():
    """The README's `make repro` minutes and peak memory are reports/tables/timing.md's span and largest peak."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    timing = (ROOT / "reports/tables/timing.md").read_text()
    stated = re.search(
        r"`make repro` ran from first start to last finish in (\d+\.\d) min, each in at most "
        r"(\d+\.\d) GiB",
        readme,
    )
    span = re.search(r"last recorded finish: \d+ s \((\d+\.\d) min\)", timing)
    peak = re.search(r"\| \*\*total\*\* \|[^\n]*\| (\d+) \(max\) \|", timing)
    assert stated and span and peak, "README.md or reports/tables/timing.md lost the sentence or the total row"
    assert stated[1] == span[1]
    assert float(stated[2]) == round(int(peak[1]) / 1024, 1)


def test_the_data_docs_size_is_the_imports_size():
    """docs/data.md: "the 33 MB of data": the four imports' sizes in data/raw/*.dvc."""
    import yaml

    imports = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "data/raw").glob("*.dvc"))]
    size = sum(out["size"] for d in imports for out in d["outs"])
    assert len(imports) == 4 and f"the {size / 1e6:.0f} MB of data" in " ".join(
        (ROOT / "docs/data.md").read_text().split()
    )


def test_the_backbone_docs_cpu_profile_is_params_yaml():
    """docs/backbone.md: the CPU profile is "one seed, 3 rounds, 16 training examples per client, greedy decoding of 8
    test examples per client": params.yaml's."""
    import yaml

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    train, evaluate = params["train"], params["evaluate"]
    text = " ".join((ROOT / "docs/backbone.md").read_text().split())
    assert len(params["partition"]["seeds"]) == 1 and evaluate["num_beams"] == 1
    assert (
        f"(one seed, {train['rounds']} rounds, {train['max_train_examples_per_client']} training examples per client, "
        f"greedy decoding of {evaluate['test_examples_per_client']} test examples per client)"
    ) in text


def test_the_readmes_test_time_limit_is_pyprojects():
    """README.md: "pytest-timeout: 120 s unless a test carries its own": pyproject.toml's default."""
    import tomllib

    limit = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]
    assert f"(pytest-timeout: {limit} s unless a test carries its own)" in " ".join(
        (ROOT / "README.md").read_text().split()
    )


def test_the_readmes_setup_and_repro_numbers_are_the_makefiles_and_pyprojects():
    """README.md: "torch 2.13.0 CPU wheel first" (pyproject.toml's pin, which the Makefile installs first), "two at a
    time where independent" (the Makefile's REPRO_JOBS lanes), and the last run's date (reports/tables/timing.md's
    finish times: the run the README's minutes and memory come from)."""
    import tomllib

    readme = " ".join((ROOT / "README.md").read_text().split())
    makefile = (ROOT / "Makefile").read_text()
    pins = [d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"] if "torch" in d]
    version = pins[0].split("==")[1]
    assert pins == [f"torch=={version}"] and f"pip install -q torch=={version}" in makefile
    assert f"(torch {version} CPU wheel first, so nothing pulls a CUDA build)" in readme
    jobs = int(re.search(r"^REPRO_JOBS \?= (\d+)$", makefile, re.M)[1])
    assert "xargs -P $(REPRO_JOBS)" in makefile and {2: "two"}[jobs] + " at a time where independent" in readme
    finished = set(
        re.findall(r"\| (\d{4}-\d\d-\d\d)T[\d:]+\+00:00 \|", (ROOT / "reports/tables/timing.md").read_text())
    )
    # the day it started; every stage ran (forced, a fresh machine's empty cache, code each stage reads changed, or
    # both), so the table times them all
    assert re.search(
        rf"In the last run \({min(finished)}, every stage (forced|ran on a fresh machine|ran after code changes|ran after code changes or was forced)\)",
        readme,
    )


def test_the_package_versions_the_docs_name_are_pyprojects_pins():
    """Every "Flower 1.41" / "flwr 1.41", "opacus 1.6", "MLflow 3.17", "rouge-score 0.1.2" and "the pinned 5.23"
    (transformers) in README.md and docs/*.md is (a prefix of) the version pyproject.toml pins."""
    import tomllib

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = dict(d.split("==") for d in dependencies if "==" in d)
    names = {"flower": "flwr", "flwr": "flwr", "opacus": "opacus", "mlflow": "mlflow", "rouge-score": "rouge-score"}
    found, wrong = 0, []
    for doc in DOCS:
        text = " ".join(doc.read_text().split())
        mentions = [
            (names[m[0].lower()], m[1])
            for m in re.findall(r"\b(Flower|flwr|opacus|MLflow|rouge-score) (\d+\.\d+[\d.]*)", text)
        ]
        mentions += [("transformers", v) for v in re.findall(r"\(the pinned (\d+\.\d+)'s name\)", text)]
        found += len(mentions)
        wrong += [
            f"{doc.name}: {pkg} {v} (pinned {pins[pkg]})"
            for pkg, v in mentions
            if not f"{pins[pkg]}.".startswith(f"{v}.")
        ]
    assert found >= 10 and not wrong, wrong


def test_the_federation_docs_timeouts_heartbeats_and_secagg_messages_are_the_codes():
    """docs/federation.md: the admission and round timeouts' defaults (params.yaml's, and RunSettings' when a run
    config leaves them out), "two missed 30 s heartbeats" (Flower's patience and default interval; docs/performance.md
    "60 s to notice a lost node"), and "4 train messages per client and round" of SecAgg+ (its stages; the same in
    docs/privacy.md)."""
    import yaml
    from flwr.common import constant
    from flwr.common.secure_aggregation.secaggplus_constants import Stage

    from pipeline.experiments.settings import RunSettings

    text = " ".join((ROOT / "docs/federation.md").read_text().split())
    train = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]
    admission, round_ = train["admission_timeout_s"], train["round_timeout_s"]
    assert (admission, round_) == (RunSettings.admission_timeout_s, RunSettings.round_timeout_s)
    assert f"(run config `admission-timeout-s`; default {admission:g} s)" in text
    assert f"(`train.round_timeout_s`, run config `round-timeout-s`; default {round_:g} s)" in text
    patience, interval = constant.HEARTBEAT_PATIENCE, constant.HEARTBEAT_DEFAULT_INTERVAL
    assert f"({ {2: 'two'}[patience] } missed {interval} s heartbeats)" in text
    assert f"{patience * interval} s to notice a lost node" in " ".join(
        (ROOT / "docs/performance.md").read_text().split()
    )
    stages = len(Stage.all())
    assert f"docs/privacy.md; {stages} train messages per client and round" in text
    assert f"sends each client {stages} train messages" in " ".join((ROOT / "docs/privacy.md").read_text().split())


def test_the_backbone_docs_model_warm_up_and_presets_are_the_records_and_configs():
    """docs/backbone.md: the offline backbone's layers, hidden size, vocabulary and parameters (a committed
    backbone record, reports/cpu-study/backbone.json), the CPU profile's warm-up (params.yaml), and each paper
    preset's row of the table (k, m, lr, batch, weight decay, lambda, tau, seeds, beam: configs/paper-*.yaml)."""
    import json

    import yaml

    text = " ".join((ROOT / "docs/backbone.md").read_text().split())
    record = json.loads((ROOT / "reports/cpu-study/backbone.json").read_text())
    assert (
        f"({record['decoder_layers']} layers, hidden size {record['hidden_size']}, uncased "
        f"{record['vocab_size'] - 1:,}-WordPiece vocabulary plus `{record['sep_token']}`, "
        f"{record['parameters'] / 1e6:.0f}M parameters)"
    ) in text
    warmup = yaml.safe_load((ROOT / "params.yaml").read_text())["backbone"]["warmup"]
    assert (
        f"(`backbone.warmup`: {warmup['steps']} steps of {warmup['batch_size']} dialogues in the CPU profile)" in text
    )
    lines = (ROOT / "docs/backbone.md").read_text().splitlines()
    rows = {
        c[0].strip("` "): c[1] for c in (ln.strip("| ").split(" | ") for ln in lines if ln.startswith("| `configs/"))
    }
    for name in ("paper-bart-large", "paper-bart-base", "paper-led-large"):
        preset = yaml.safe_load((ROOT / f"configs/{name}.yaml").read_text())
        model, train = preset["model"], preset["train"]
        row = rows[f"configs/{name}.yaml"]
        seeds = {e["seed"] for e in preset["experiments"].values()}
        assert row.split(", ")[1:3] == [f"k={model['top_k']}", f"m={model['bottleneck']}"], row
        assert f"{len(seeds)} seeds" in row and seeds == set(preset["partition"]["seeds"]), row
        if name == "paper-bart-large":
            batch = train["batch_size"] * train["grad_accum_steps"]
            assert (
                f"lr {train['lr']:.0e}, batch {batch}, weight decay {train['weight_decay']}, lambda "
                f"{train['kd_lambda']}, tau {preset['tau']:g}, {len(seeds)} seeds, full data, beam "
                f"{preset['evaluate']['num_beams']}, every study"
            ).replace("e-04", "e-4") in row
            assert train["max_train_examples_per_client"] is None


def test_the_data_docs_reliability_run_time_is_the_committed_reports():
    """docs/data.md: `make reliability` took "87 s in the last run", reports/reliability.md's run line (it said
    "about a minute" for 87 s)."""
    seconds = re.search(r"cases in (\d+) s\.", (ROOT / "reports/reliability.md").read_text())[1]
    text = " ".join((ROOT / "docs/data.md").read_text().split())
    assert f"tries these faults on purpose ({seconds} s in the last run)" in text


def test_the_performance_docs_make_settings_are_the_makefiles_and_pyprojects():
    """docs/performance.md: `make repro` two at a time (REPRO_JOBS), test-all's three workers (TEST_ALL_JOBS),
    MUTANTS_JOBS and MUTANTS_NICE's defaults, and the `pytest<9.2` pin."""
    import tomllib

    text = " ".join((ROOT / "docs/performance.md").read_text().split())
    makefile = (ROOT / "Makefile").read_text()
    var = lambda name: int(re.search(rf"^{name} \?= (\d+)$", makefile, re.M)[1])  # noqa: E731
    words = {1: "one", 2: "two", 3: "three", 4: "four"}
    assert f"`make repro` runs independent stages {words[var('REPRO_JOBS')]} at a time" in text
    assert f"runs {words[var('TEST_ALL_JOBS')]} workers (`TEST_ALL_JOBS`)" in text
    assert f"`MUTANTS_JOBS` (default {var('MUTANTS_JOBS')}) and `MUTANTS_NICE` (default {var('MUTANTS_NICE')})" in text
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    pin = next(d for d in dev if d.startswith("pytest>=")).split("<")[1]
    assert f"pytest {pin} broke that silently" in text and f"hence the `pytest<{pin}` pin" in text


def test_the_architecture_docs_package_cycles_are_the_layer_tests():
    """docs/ARCHITECTURE.md: "any of the five package cycles of issue 55, experiments-training, ..., breaks it":
    tests/test_layers.py's NAMED_CYCLES, in number and names."""
    from tests.test_layers import NAMED_CYCLES

    text = " ".join((ROOT / "docs/ARCHITECTURE.md").read_text().split())
    words = {4: "four", 5: "five", 6: "six"}
    pairs = ", ".join(f"{a}-{b}" for a, b in NAMED_CYCLES)
    assert f"any of the {words[len(NAMED_CYCLES)]} package cycles of issue 55, {pairs}, breaks it" in text


def test_the_architecture_docs_size_rules_are_the_layer_tests_and_ruffs():
    """docs/ARCHITECTURE.md: "no module over 400 lines" (tests/test_layers.py's MAX_MODULE_LINES), "no function over
    60 statements" (pyproject.toml's ruff max-statements) and the ceiling's "14,607 lines when it was set" (the
    ceiling's own comment in tests/test_layers.py)."""
    import tomllib

    from tests.test_layers import MAX_MODULE_LINES

    text = " ".join((ROOT / "docs/ARCHITECTURE.md").read_text().split())
    statements = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]["pylint"]
    first = re.search(r"Set at ([\d,]+) lines", (ROOT / "tests/test_layers.py").read_text())[1]
    assert f"no module over {MAX_MODULE_LINES} lines as ruff formats it" in text
    assert f"no function over {statements['max-statements']} statements (ruff's PLR0915" in text
    assert f"({first} lines when it was set;" in text


def test_the_committed_data_statistics_are_the_rendering_of_their_json():
    """reports/data/stats.md (Table II ours / paper, the other corpora, skipped records, meeting links) is what the
    examples stage renders from reports/data/stats.json (both committed: a hand edit of one fails here)."""
    import json

    from pipeline.datasets.examples import stats_markdown

    stats = json.loads((ROOT / "reports/data/stats.json").read_text())
    skipped, links = stats.pop("skipped"), stats.pop("meeting_links")
    assert (ROOT / "reports/data/stats.md").read_text() == stats_markdown(stats, skipped, links)


def test_the_performance_docs_warm_up_measurements_are_params_yamls():
    """docs/performance.md's warm-up recipe numbers (150 x 8 against 120 x 16: 195 vs 334 s, 2.81 vs 5.38 GB, ROUGE-1
    13.12; activation checkpointing 5.38 -> 3.55 GB for 334 -> 438 s; fused AdamW 0.15 -> 0.03 s a step) are the
    measurements params.yaml records beside backbone.warmup (it says so), for the recipe it sets."""
    import yaml

    params = (ROOT / "params.yaml").read_text()
    warmup = yaml.safe_load(params)["backbone"]["warmup"]
    comments = " ".join(line.split("#", 1)[1].strip() for line in params.splitlines() if "#" in line)
    new = re.search(
        r"(\d+) x (\d+), off: ([\d.]+), ROUGE-1 ([\d.]+), (\d+) s, ([\d.]+) GB",
        comments[comments.find("200 x 8") + 8 :],
    )
    old = re.search(
        r"(\d+) x (\d+), attention dropout on [^:]*: loss [\d.]+, ROUGE-1 [\d.]+, (\d+) s, ([\d.]+) GB", comments
    )
    checkpointing = re.search(r"peak RSS fell ([\d.]+) -> ([\d.]+) GB for (\d+) -> (\d+) s", comments)
    fused = re.search(r"\(([\d.]+) -> ([\d.]+) s a step on 2", comments)
    assert (int(new[1]), int(new[2])) == (warmup["steps"], warmup["batch_size"])
    text = " ".join((ROOT / "docs/performance.md").read_text().split())
    assert (
        f"{new[1]} x {new[2]} dialogues reach a better SAMSum score than the earlier {old[1]} x {old[2]} in {new[5]} "
        f"instead of {old[3]} s, at {new[6]} instead of {old[4]} GB peak (the measurements are in params.yaml)"
    ) in text
    assert f"took {fused[1]} s as the per-tensor loop and {fused[2]} s fused" in text and warmup["fused_adamw"]
    assert f"(ROUGE-1 {new[4]} and loss" in text
    assert f"{checkpointing[1]} -> {checkpointing[2]} GB for {checkpointing[3]} -> {checkpointing[4]} s" in text
