"""MkDocs hooks: the pages kept at the repository's root, links to the rest of the repository, the version.

- README.md, ARCHITECTURE.md, CHANGELOG.md, benchmarks/README.md and the harness adapter's README stay
  where GitHub and PyPI show them; the site renders them as ``index.md``, ``architecture.md``,
  ``changelog.md``, ``benchmarks.md`` and ``benchmarks-harness.md``.
- Every page's links are written for the repository as it is checked out (``docs/x.md`` from the
  README, ``../examples/flask_app.py`` from a page), so they work on GitHub and in an editor. Here
  they are rewritten for the site: a link into docs/ points to its page, a link to one of those
  pages to its rendering, and a link to any other file of the repository (an example, the
  benchmark chart) to a copy served with the site under ``_repo/``. A link to a file that does not
  exist is left alone, so that the strict build fails on it.
- The footer shows the package's version, read where hatch reads it (``__version__`` in
  ``dramatiq_pg_fenced/config.py``), so it is written in one place.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

#: the repository's pages outside docs/ rendered as pages of the site, and their names there
ROOT_PAGES = {
    "README.md": "index.md",
    "ARCHITECTURE.md": "architecture.md",
    "CHANGELOG.md": "changelog.md",
    "benchmarks/README.md": "benchmarks.md",
    "benchmarks/harness/dramatiq-pg-fenced-bench/README.md": "benchmarks-harness.md",
}
#: where copies of the other repository files linked from a page are served
REPO_FILES = "_repo/"

# An inline link or image target: ](target) or ](target "title"); code spans and fenced blocks are skipped.
LINK = re.compile(r"\]\(([^()\s]+)((?:\s+\"[^\"]*\")?)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def repo_root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def version(root: Path) -> str:
    text = (root / "dramatiq_pg_fenced" / "config.py").read_text()
    found = re.search(r'^__version__ = "([^"]+)"', text, flags=re.M)
    if found is None:
        raise ValueError("no __version__ in dramatiq_pg_fenced/config.py")
    return found.group(1)


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    config.copyright = f"dramatiq-pg-fenced {version(repo_root(config))} · LGPL-3.0-or-later"
    return config


def repo_path_of(file: File, docs: str) -> str:
    """Where a page's source is in the repository (``docs/x.md``, or ``README.md`` for the home page)."""
    for root_name, uri in ROOT_PAGES.items():
        if file.src_uri == uri and file.generated_by is not None:
            return root_name
    return posixpath.join(docs, file.src_uri)


def targets(markdown: str) -> list[tuple[int, int, str]]:
    """(start, end, target) of every link target outside code, in order."""
    found, offset, fenced = [], 0, False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            spans = [m.span() for m in CODE_SPAN.finditer(line)]
            for m in LINK.finditer(line):
                if not any(a <= m.start() < b for a, b in spans):
                    found.append((offset + m.start(1), offset + m.end(1), m.group(1)))
        offset += len(line)
    return found


def site_uri(target: str, source: str, docs: str, root: Path) -> str | None:
    """The site's file for a link target written in the repository file ``source``; None: leave it."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I) or target.startswith(("#", "/")):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    in_repo = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
    if in_repo.startswith("../"):
        return None
    if in_repo in ROOT_PAGES:
        return ROOT_PAGES[in_repo]
    if in_repo.startswith(docs + "/"):
        return in_repo[len(docs) + 1 :]
    if (root / in_repo).is_file():
        return REPO_FILES + in_repo
    return None


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = repo_root(config)
    docs = Path(config.docs_dir).resolve().relative_to(root).as_posix()
    for name, uri in ROOT_PAGES.items():
        if (root / name).is_file():
            files.append(File.generated(config, uri, abs_src_path=str(root / name)))
    served = {f.src_uri for f in files}
    for file in list(files.documentation_pages()):
        source = repo_path_of(file, docs)
        for _, _, target in targets(Path(file.abs_src_path or "").read_text()):
            uri = site_uri(target, source, docs, root)
            if uri and uri.startswith(REPO_FILES) and uri not in served:
                files.append(File.generated(config, uri, abs_src_path=str(root / uri[len(REPO_FILES) :])))
                served.add(uri)
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    root = repo_root(config)
    docs = Path(config.docs_dir).resolve().relative_to(root).as_posix()
    source = repo_path_of(page.file, docs)
    here = posixpath.dirname(page.file.src_uri)
    for start, end, target in reversed(targets(markdown)):
        uri = site_uri(target, source, docs, root)
        if uri is None:
            continue
        anchor = target[len(target.split("#", 1)[0]) :]
        markdown = markdown[:start] + posixpath.relpath(uri, here or ".") + anchor + markdown[end:]
    return markdown
