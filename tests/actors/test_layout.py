"""The runtime's tests stand without the pipeline, as the runtime does (import-linter checks the packages)."""

from __future__ import annotations

import ast
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _imported_modules(path: str) -> set[str]:
    tree = ast.parse(open(path).read())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_runtime_test_imports_the_pipeline():
    offenders = {
        name: sorted(m for m in _imported_modules(os.path.join(HERE, name)) if m.split(".")[0] in ("pipeline",))
        for name in sorted(os.listdir(HERE))
        if name.endswith(".py")
    }
    assert not {name: mods for name, mods in offenders.items() if mods}, offenders
