"""The docs stay true: ARCHITECTURE.md's module map names every module, and every command in README/docs exists."""

from __future__ import annotations

import re
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
        bodies = [_strip_parentheses(text)] + [_strip_parentheses(_parenthesised(text, m.end())) for m in re.finditer(r"\w+/ \(", text)]
        for chunk in re.split(r"[,;:]|\band\b", " , ".join(bodies)):
            chunk = chunk.strip().rstrip("/").removeprefix("+ ").strip()
            if re.fullmatch(r"[a-z][a-z0-9_]*", chunk) and chunk not in modules[package]:
                stale.append(f"{package}/{chunk}")
    assert not stale, f"names in docs/ARCHITECTURE.md's module map that are not modules: {sorted(stale)}"
