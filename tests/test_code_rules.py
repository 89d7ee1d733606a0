"""Rules of the source that keep it readable, checked on its syntax trees:

- the package arrows (README's layout): experiments -> research -> (parallel, optim); optim
  imports nothing of the repo but parallel's collectives, their accounting, flight recorder
  and hang detector, and the marks (so other trainers can take it alone);
  parallel never imports research or optim. Every import statement counts, also those inside
  functions;
- no import cycle between modules of the repo;
- no function longer than 50 lines (its docstring not counted);
- no class of optim/ inherits from another class of the repo: the optimizer is composed of
  objects, not mixins."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGES = ("optim", "parallel", "research", "experiments")
ALLOWED = {
    "optim": {"optim", "parallel.comm", "parallel.marks", "parallel.accounting", "parallel.flight", "parallel.desync"},
    "parallel": {"parallel"},
    "research": {"research", "parallel", "optim"},
}


def modules() -> dict[str, Path]:
    """Every module of the source packages, by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


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


def module_graph() -> dict[str, set[str]]:
    """Module -> the repo modules it imports (`from optim import fused` is optim.fused,
    `from optim import ZeroOptimizer` is optim)."""
    found = modules()

    def module_of(name: str) -> str | None:
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name or None

    def imported(path: Path) -> set[str | None]:
        names: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {module_of(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names |= {module_of(f"{node.module}.{alias.name}") for alias in node.names}
        return names

    return {name: imported(path) - {None, name} for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    assert cycles(module_graph()) == [], "modules that import each other, directly or through others"


def test_the_cycle_check_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


MAX_FUNCTION_LINES = 50


def long_functions(path: Path) -> list[str]:
    """The functions of a file longer than MAX_FUNCTION_LINES, docstring left out."""
    long = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if ast.get_docstring(node) is not None:
                doc = node.body[0]
                lines -= doc.end_lineno - doc.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return long


def test_functions_are_short() -> None:
    long = [f for path in sorted(modules().values()) for f in long_functions(path)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: split them ({long})"


def test_optim_composes_rather_than_inherits() -> None:
    """Bases of optim's classes come from torch, the standard library or the framework an
    integration adapts, never from a class of the repo (defined in the file or imported from
    a repo module)."""
    inherited = []
    for path in sorted((ROOT / "optim").rglob("*.py")):
        tree = ast.parse(path.read_text())
        ours = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                ours |= {alias.asname or alias.name for alias in node.names}
        inherited += [
            f"{path.relative_to(ROOT)}: {node.name}({ast.unparse(base)})"
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef)
            for base in node.bases
            if ast.unparse(base).split(".")[0] in ours
        ]
    assert not inherited, f"classes of optim/ built on another class of the repo: {inherited}"


def private_members(paths: list[Path]) -> dict[str, set[Path]]:
    """Each underscore name (not dunder) a class of the repo defines, as a method or as an
    attribute of `self`, -> the files defining it. Protocols define interfaces, not members."""
    found: dict[str, set[Path]] = {}
    for path in paths:
        for cls in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(cls, ast.ClassDef) or any("Protocol" in ast.unparse(b) for b in cls.bases):
                continue
            for node in ast.walk(cls):
                name = None
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = node.name
                elif (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                ):
                    name = node.attr
                if name and name.startswith("_") and not name.startswith("__"):
                    found.setdefault(name, set()).add(path)
    return found


def foreign_private_access(paths: list[Path]) -> list[str]:
    """`obj._name` (obj not self / cls) in a file where `_name` is a member of a repo class
    defined only in other files: one object reaching into another's internals."""
    members = private_members(paths)
    breaches = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute) or node.attr not in members or path in members[node.attr]:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            breaches.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return breaches


def test_no_object_reaches_into_another_modules_internals() -> None:
    paths = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))
    breaches = foreign_private_access(paths)
    assert not breaches, f"underscore members of another module's class used: make them public ({breaches})"


def test_the_internals_rule_sees_a_breach(tmp_path: Path) -> None:
    owner, user = tmp_path / "owner.py", tmp_path / "user.py"
    owner.write_text("class A:\n    def __init__(self):\n        self._x = 1\n    def _f(self):\n        pass\n")
    user.write_text("def g(a):\n    a._f()\n    return a._x + a.__class__.__name__.__len__()\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert foreign_private_access([owner, user]) == ["user.py:2 a._f", "user.py:3 a._x"]
    finally:
        ROOT = saved


def lambda_wiring(path: Path) -> list[str]:
    """Lambdas handed to a constructor (a call of a capitalized name) or as an `on_*`
    argument: parts wired together by anonymous callbacks instead of by their methods."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        callee = ast.unparse(node.func).split(".")[-1]
        constructor = callee[:1].isupper()
        wired = [a for a in node.args if isinstance(a, ast.Lambda) and constructor]
        wired += [
            k.value
            for k in node.keywords
            if isinstance(k.value, ast.Lambda) and (constructor or (k.arg or "").startswith("on_"))
        ]
        found += [f"{path.relative_to(ROOT)}:{w.lineno} {callee}(... {ast.unparse(w)} ...)" for w in wired]
    return found


def test_optim_wires_no_parts_with_lambdas() -> None:
    wired = [w for path in sorted((ROOT / "optim").rglob("*.py")) for w in lambda_wiring(path)]
    assert not wired, f"pass the object (or its bound method) instead: {wired}"


def test_the_wiring_rule_sees_a_lambda(tmp_path: Path) -> None:
    source = tmp_path / "parts.py"
    source.write_text(
        "r = Reducer(b, on_end=lambda s: t.end(s))\nx = sorted(b, key=lambda k: k)\nf(on_done=lambda: 0)\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert [w.split(" ")[0] for w in lambda_wiring(source)] == ["parts.py:1", "parts.py:3"]
    finally:
        ROOT = saved
