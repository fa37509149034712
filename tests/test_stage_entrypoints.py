"""Every stage module can run as ``python -m pipeline.<stage>``: the ``__main__`` block must not rebind a
module-level function (``from pipeline.common.cli import run`` once shadowed postag's ``run()``, and the stage crashed)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PIPELINE = Path(__file__).resolve().parents[1] / "pipeline"
STAGES = sorted(p for p in PIPELINE.glob("*.py") if "__main__" in p.read_text())


def _main_block_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names |= {a.asname or a.name.split(".")[0] for a in sub.names}
                elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
    return names


@pytest.mark.parametrize("path", STAGES, ids=lambda p: p.stem)
def test_main_block_does_not_shadow_module_functions(path):
    tree = ast.parse(path.read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not (_main_block_names(tree) & defined), f"{path.name}: __main__ rebinds {_main_block_names(tree) & defined}"


def test_the_check_sees_a_shadowing_block():
    tree = ast.parse("def run():\n    pass\nif __name__ == '__main__':\n    from pipeline.common.cli import run\n")
    assert _main_block_names(tree) == {"run"}
