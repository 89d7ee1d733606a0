"""The package arrows (README's layout): experiments -> research -> (parallel, optim); optim imports
nothing of the repo but parallel/comm.py (so other trainers can take it alone); parallel never
imports research or optim. Every import statement counts, also those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGES = ("optim", "parallel", "research", "experiments")
ALLOWED = {
    "optim": {"optim", "parallel.comm"},
    "parallel": {"parallel"},
    "research": {"research", "parallel", "optim"},
}


def repo_imports(path: Path) -> set[str]:
    """The repo modules a file imports (`from parallel import comm` counts as parallel.comm)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
    return {name for name in found if name.split(".")[0] in PACKAGES}


def allowed(name: str, rules: set[str]) -> bool:
    """Whether `name` or the module it names from (`parallel.comm.mark_tied`) is allowed."""
    return any(name == rule or name.startswith(rule + ".") or rule.startswith(name + ".") for rule in rules)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package: str) -> None:
    broken = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in repo_imports(path)
        if not allowed(name, ALLOWED[package])
    }
    assert not broken, f"imports against the package arrows: {sorted(broken)}"


def test_the_rule_sees_a_breach(tmp_path: Path) -> None:
    """A lazy import of research inside an optim function is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from parallel.dims import ParallelDims\n    import research.model\n")
    names = repo_imports(bad)
    assert {n for n in names if not allowed(n, ALLOWED["optim"])} == {
        "parallel.dims",
        "parallel.dims.ParallelDims",
        "research.model",
    }
