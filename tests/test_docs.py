"""The README stays a front page and the docs stay connected: README.md is at most 200 lines,
every relative link in README.md and docs/*.md reaches a file (and, with #anchor, a heading
of it), and every flag in a ```bash line that runs experiments.train is one the trainer takes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`+[^`]*`+")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
TRAIN = re.compile(r"experiments\.train\b")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def prose_lines(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def bash_blocks(text: str) -> list[list[str]]:
    """The lines of each ```bash fenced block, backslash continuations joined into one line."""
    blocks, current, fenced = [], None, False
    for line in text.splitlines():
        if FENCE.match(line):
            if not fenced and line.strip().lstrip("`~").strip().startswith(("bash", "sh", "shell")):
                current = []
            elif fenced and current is not None:
                blocks.append(current)
                current = None
            fenced = not fenced
            continue
        if current is not None:
            if current and current[-1].endswith("\\"):
                current[-1] = current[-1][:-1] + " " + line.strip()
            else:
                current.append(line)
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, repeated ones numbered as GitHub numbers them."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(page.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_slug_is_githubs() -> None:
    assert slug("Gradient reduction under accumulation (`--grad-sync`)") == (
        "gradient-reduction-under-accumulation---grad-sync"
    )
    assert slug("Hybrid sharding and ZeRO++") == "hybrid-sharding-and-zero"
    assert slug("4. At stage 3: evaluate and save on every rank") == "4-at-stage-3-evaluate-and-save-on-every-rank"


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/ (at most 200)"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{target}: no file {_name(dest)}")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{_name(page)}: broken links: {broken}"


@pytest.fixture(scope="module")
def trainer_flags() -> set[str]:
    from research.config import build_parser

    return {s for action in build_parser()._actions for s in action.option_strings}


def test_the_flag_scan_finds_the_set_up_command(trainer_flags: set[str]) -> None:
    lines = [
        line
        for block in bash_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
        for line in block
        if TRAIN.search(line)
    ]
    assert lines, "no experiments.train command in README.md's bash blocks"
    assert {"--tp", "--pp", "--zero", "--config"} <= trainer_flags


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_train_commands_use_real_flags(page: Path, trainer_flags: set[str]) -> None:
    unknown = []
    for block in bash_blocks(page.read_text(encoding="utf-8")):
        for line in block:
            m = TRAIN.search(line)
            if not m or "..." in line:
                continue
            args = line[m.end() :].split(" #", 1)[0]  # the trainer's own arguments, not torchrun's or a comment
            unknown += [f"{flag} in: {line.strip()}" for flag in FLAG.findall(args) if flag not in trainer_flags]
    assert not unknown, f"{_name(page)}: flags experiments.train does not take: {unknown}"


# ---- every repo command and import the docs show exists ---------------------------------------
PYTHON_M = re.compile(r"python -m ((?:experiments|tests)(?:\.\w+)*)")
REPO_PACKAGES = ("optim", "parallel", "research", "experiments")


def module_commands() -> dict[str, set[str]]:
    """Repo module run by `python -m` in a docs bash block -> the flags the docs give it (up to
    a `--`, after which the flags are another command's)."""
    found: dict[str, set[str]] = {}
    for page in PAGES:
        for block in bash_blocks(page.read_text(encoding="utf-8")):
            for line in block:
                for m in PYTHON_M.finditer(line):
                    args = line[m.end() :].split(" #", 1)[0].split(" -- ", 1)[0].split("&&", 1)[0].split("|", 1)[0]
                    found.setdefault(m[1], set()).update(FLAG.findall(args) if "..." not in args else [])
    return found


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(set(module_commands()) - {"tests.test_docs"}))
def test_documented_commands_run_and_take_their_flags(module: str) -> None:
    """`python -m MODULE --help` runs for every command the docs show, and lists each flag
    they give it."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"python -m {module} --help failed: {done.stderr[-2000:]}"
    unknown = sorted(flag for flag in module_commands()[module] - {"--help"} if flag not in done.stdout)
    assert not unknown, f"the docs give python -m {module} flags it does not take: {unknown}"


def python_blocks(text: str) -> list[str]:
    """The source of each ```python fenced block."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_documented_imports_exist(page: Path) -> None:
    """Every `from repo_module import name` in a python block names something that exists."""
    import ast
    import importlib
    import importlib.util

    missing = []
    for source in python_blocks(page.read_text(encoding="utf-8")):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in REPO_PACKAGES:
                if node.module.startswith("optim.integrations."):
                    continue  # imports Lightning / transformers / accelerate, which the tests need not have
                module = importlib.import_module(node.module)
                missing += [
                    f"{node.module}.{a.name}"
                    for a in node.names
                    if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None
                ]
    assert not missing, f"{_name(page)}: names its python blocks import that do not exist: {missing}"


# ---- the options table of docs/optimizer.md is rendered from optim/policies.py -------------
OPTIONS_PAGE = ROOT / "docs" / "optimizer.md"
OPTIONS_BEGIN = "<!-- options: rendered from optim/policies.py by `python -m tests.test_docs` -->"
OPTIONS_END = "<!-- /options -->"


def field_docs(cls: type) -> dict[str, str]:
    """A policy's "Attributes:" docstring section as field -> one-line description."""
    import inspect

    doc = inspect.getdoc(cls) or ""
    fields: dict[str, str] = {}
    name = None
    for line in doc.split("Attributes:", 1)[1].splitlines():
        match = re.match(r"^    (\w+): (.*)$", line)
        if match:
            name = match[1]
            fields[name] = match[2]
        elif line.startswith("        ") and name is not None:
            fields[name] += " " + line.strip()
    return fields


def options_markdown() -> str:
    """One section per policy: its docstring's summary, then field | default | meaning."""
    import dataclasses
    import inspect

    from optim import policies

    parts = []
    for argument, cls in policies.POLICY_CLASSES.items():
        summary = (inspect.getdoc(cls) or "").split("Attributes:", 1)[0].strip().replace("\n", " ")
        rows = [f"| `{f.name}` | `{f.default!r}` | {field_docs(cls)[f.name]} |" for f in dataclasses.fields(cls)]
        parts.append(
            f"### `{argument}={cls.__name__}(...)`\n\n{summary}\n\n| field | default | meaning |\n|---|---|---|\n"
            + "\n".join(rows)
        )
    return "\n\n".join(parts)


def rendered_options_section(text: str) -> tuple[int, int]:
    begin, end = text.index(OPTIONS_BEGIN) + len(OPTIONS_BEGIN), text.index(OPTIONS_END)
    return begin, end


def test_options_are_rendered_from_the_policies() -> None:
    """Each option is documented once, in its policy's docstring; the docs show the rendering."""
    text = OPTIONS_PAGE.read_text()
    begin, end = rendered_options_section(text)
    assert text[begin:end].strip() == options_markdown(), (
        "docs/optimizer.md's options differ from optim/policies.py: run python -m tests.test_docs"
    )


def test_every_policy_field_is_documented() -> None:
    import dataclasses

    from optim import policies

    for cls in policies.POLICY_CLASSES.values():
        assert set(field_docs(cls)) == {f.name for f in dataclasses.fields(cls)}, cls.__name__


if __name__ == "__main__":
    page = OPTIONS_PAGE.read_text()
    begin, end = rendered_options_section(page)
    OPTIONS_PAGE.write_text(page[:begin] + "\n\n" + options_markdown() + "\n\n" + page[end:])
