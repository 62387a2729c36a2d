"""Every example's own command works from the extras it names.

Each ``examples/*.py`` names, in its docstring, the ``pip install`` line that runs it and its commands;
README.md and docs/*.md run some of them after a ``pip install '...[extra]'`` line of their own. Here
each such command is checked against pyproject.toml: what the example imports (and what the package's
modules it imports need in turn), and the command's own program (``uvicorn``, ``flask``...), must be
installed by the package's dependencies plus the extras that install line names, followed through
their own requirements. (``uvicorn examples.fastapi_app:app`` once failed so: uvicorn was in no extra.)

No network and no install: the requirements are followed through the distributions installed here
(the ``test`` extra installs them all).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib", reason="tomllib (Python 3.11+) reads pyproject.toml")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
PACKAGE = "dramatiq_pg_fenced"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
SELF = canonicalize_name(PYPROJECT["name"])

#: An install line of this package: ``pip install -e '.[x,y]'``, ``pip install 'dramatiq-pg-fenced[x]'``, or a path
#: to a checkout (``/path/to/dramatiq-pg-fenced[x]``); group 1: the extras.
PIP_INSTALL = re.compile(r"pip install (?:-e )?'?(?:\.|[\w./-]*dramatiq-pg-fenced)(?:\[([\w,-]+)\])?'?(?=[\s`]|$)")
#: A command that runs an example: (its program, the example's name).
EXAMPLE_COMMAND = re.compile(
    r"(?:^|[\s`(])(python|uvicorn|flask|dramatiq|pytest)\s+(?:--app\s+)?examples[/.](\w+)", re.MULTILINE
)


# -- what an install line installs --------------------------------------------------------------


def _wanted(requirement: str, extras: frozenset[str]) -> Requirement | None:
    req = Requirement(requirement)
    if req.marker is None:
        return req
    envs = [{"extra": e} for e in extras] or [{"extra": ""}]
    return req if any(req.marker.evaluate(env) for env in envs) else None


@cache
def installed_by(extras: frozenset[str], others: frozenset[str] = frozenset()) -> frozenset[str]:
    """The distributions ``pip install 'dramatiq-pg-fenced[extras]' others...`` installs (canonical names)."""
    unknown = extras - set(PYPROJECT["optional-dependencies"])
    assert not unknown, f"no such extra in pyproject.toml: {sorted(unknown)}"
    found: set[str] = {SELF}
    todo: list[tuple[str, frozenset[str]]] = []
    own = [*PYPROJECT["dependencies"], *others] + [r for e in extras for r in PYPROJECT["optional-dependencies"][e]]
    for requirement in own:
        req = Requirement(requirement)
        todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted_extras = todo.pop()
        if (name, wanted_extras) in seen:
            continue
        seen.add((name, wanted_extras))
        if name == SELF:  # dramatiq-pg-fenced[frameworks] in another extra
            found |= installed_by(wanted_extras)
            continue
        found.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            pytest.fail(f"{name} is not installed here: install the test extra (pip install -e '.[test]')")
        for requirement in requires:
            req = _wanted(requirement, wanted_extras)
            if req is not None:
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return frozenset(found)


# -- what a command needs ---------------------------------------------------------------------------


@cache
def providers() -> dict[str, list[str]]:
    return md.packages_distributions()


def _required_imports(tree: ast.AST, *, all_imports: bool) -> Iterator[str]:
    """The modules *tree* imports; in the package's own modules, those an ``except ImportError`` that
    carries on without them guards (optional features) are left out, as are ``TYPE_CHECKING`` ones."""
    optional: set[int] = set()
    for node in ast.walk(tree):
        if all_imports:
            break
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            optional |= {id(n) for n in ast.walk(node)}
        if isinstance(node, ast.Try):
            tolerated = any(
                "ImportError" in ast.unparse(h.type or ast.Name("BaseException"))
                and not any(isinstance(n, ast.Raise) for n in ast.walk(h))
                for h in node.handlers
            )
            if tolerated:
                optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _package_file(module: str) -> Path | None:
    base = REPO / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def needed_by(path: Path) -> dict[str, str]:
    """The distributions running *path* needs: {distribution: the import that needs it}."""
    needs: dict[str, str] = {}
    siblings = {p.stem for p in EXAMPLES.glob("*.py")}
    todo, seen = [(path, True)], set()
    while todo:
        file, is_example = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        for module in _required_imports(ast.parse(file.read_text()), all_imports=is_example):
            top = module.partition(".")[0]
            if top in sys.stdlib_module_names or top == "__future__" or top in siblings:
                continue
            if top == PACKAGE:
                own = _package_file(module)
                if own is not None:
                    todo.append((own, False))
                continue
            dists = providers().get(top)
            assert dists, f"{file.relative_to(REPO)} imports {module}, which no installed distribution provides"
            needs.setdefault(canonicalize_name(dists[0]), f"{file.relative_to(REPO)}: import {module}")
    return needs


def program_of(program: str) -> str | None:
    """The distribution whose console script (or module) *program* is; None for ``python``."""
    if program == "python":
        return None
    for ep in md.entry_points(group="console_scripts"):
        if ep.name == program and ep.dist is not None:
            return canonicalize_name(ep.dist.name)
    if program == PYPROJECT["name"]:
        return SELF
    pytest.fail(f"no installed distribution has the program {program!r}")


# -- the commands --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    where: str  # the file and line that gives it
    program: str
    example: str  # examples/<example>.py
    extras: frozenset[str]  # what its install line names
    others: frozenset[str] = frozenset()  # and the other packages it installs beside


def _others(line: str) -> frozenset[str]:
    """The packages an install line names after the package itself (``... pytest``)."""
    match = PIP_INSTALL.search(line)
    assert match is not None, line
    return frozenset(w for w in line[match.end():].partition("#")[0].split() if re.fullmatch(r"[\w.-]+", w))


def _extras(line: str) -> frozenset[str]:
    match = PIP_INSTALL.search(line)
    assert match is not None, line
    return frozenset(e.strip() for e in (match[1] or "").split(",") if e.strip())


def docstring_commands(path: Path) -> list[Command]:
    """The commands *path*'s docstring gives (its indented lines), with its install line's extras."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    lines = [line.strip() for line in doc.splitlines() if line.startswith("    ")]
    installs = [line for line in lines if PIP_INSTALL.search(line)]
    assert len(installs) == 1, f"examples/{path.name}: its docstring names one install line (`pip install ...`)"
    extras, others = _extras(installs[0]), _others(installs[0])
    commands = []
    for line in lines:
        if line in installs:
            continue
        words = [w for w in line.partition("#")[0].split("&&")[-1].split() if "=" not in w]
        if words:
            commands.append(Command(f"examples/{path.name}: {line}", words[0], path.stem, extras, others))
    return commands


def page_commands(path: Path) -> list[Command]:
    """The commands of a page that run an example, each with the extras of the page's install line
    before it (else of the example's own)."""
    commands, extras, others = [], None, frozenset[str]()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if PIP_INSTALL.search(line):
            extras, others = _extras(line), _others(line)
        for match in EXAMPLE_COMMAND.finditer(line):
            example = match[2]
            assert (EXAMPLES / f"{example}.py").is_file(), f"{path.name}:{number} runs a missing example: {line}"
            where = f"{path.relative_to(REPO)}:{number}: {line.strip()}"
            if extras is not None:
                commands.append(Command(where, match[1], example, extras, others))
            else:
                own = docstring_commands(EXAMPLES / f"{example}.py")[0]
                commands.append(Command(where, match[1], example, own.extras, own.others))
    return commands


EXAMPLE_FILES = sorted(EXAMPLES.glob("*.py"))
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _check(command: Command) -> None:
    installed = installed_by(command.extras, command.others)
    needs = needed_by(EXAMPLES / f"{command.example}.py")
    program = program_of(command.program)
    if program is not None:
        needs.setdefault(program, f"the program {command.program}")
    missing = {dist: why for dist, why in needs.items() if dist not in installed}
    named = f"[{','.join(sorted(command.extras))}]" if command.extras else "(no extra)"
    assert not missing, f"{command.where}\n  needs what {named} does not install: {missing}"


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_each_examples_own_commands_run_from_the_extras_its_install_line_names(path: Path) -> None:
    """Given an example's docstring (its install line, then its commands), I expect each command's
    program and every module the example imports to be installed by that line's extras."""
    commands = docstring_commands(path)
    assert commands, f"examples/{path.name}: its docstring gives the command that runs it"
    for command in commands:
        _check(command)


def test_every_example_command_in_the_readme_and_the_docs_runs_from_the_extras_installed_before_it() -> None:
    """Given README.md and docs/*.md, I expect each command that runs an example to be covered by the
    page's install line before it (or the example's own), and every install line to name real extras."""
    commands = [c for page in PAGES for c in page_commands(page)]
    assert any(c.example == "quickstart" for c in commands), "the README runs the quickstart"
    for command in commands:
        _check(command)
    for page in PAGES:
        for line in page.read_text().splitlines():
            if PIP_INSTALL.search(line):
                unknown = _extras(line) - set(PYPROJECT["optional-dependencies"])
                assert not unknown, f"{page.name}: {line.strip()}: no such extra in pyproject.toml"


def test_the_check_finds_a_missing_program() -> None:
    """Given the FastAPI example's command with the frameworks extra stripped of uvicorn, as it was,
    I expect the check to name uvicorn as missing."""
    installed = installed_by(frozenset({"frameworks"})) - {"uvicorn"}
    needs = needed_by(EXAMPLES / "fastapi_app.py") | {"uvicorn": "the program uvicorn"}
    assert {d for d in needs if d not in installed} == {"uvicorn"}
