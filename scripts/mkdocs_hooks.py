"""MkDocs hooks (named in mkdocs.yml): the docs' links to repository files outside docs/.

A page may link to a file of the repository outside docs/, e.g. ``../../bench/RESULTS.md``:
that is how the link reads in the repository, on a forge or in an editor. MkDocs knows only
docs/, so each such file also goes into the site under ``repository/`` (a Markdown file as a
page, which mkdocs.yml's nav lists like any other; any other file as it is) and the links are
pointed there, where ``mkdocs build --strict`` checks them, anchors included. A link to a file
that does not exist is left as written, so the build fails on it.

``scripts/check-docs`` uses ``links`` to check README.md's links the same way.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

PREFIX = "repository"

# A fenced code block, an inline code span, or a Markdown link or image target. Code is
# skipped: a `](…)` inside it is text, not a link.
_TOKEN = re.compile(
    r"^(?P<fence>```+|~~~+)[^\n]*\n.*?^(?P=fence)[ \t]*$"
    r"|(?P<tick>`+).+?(?P=tick)"
    r"|\]\((?P<target><[^>]*>|[^)\s]+)",
    re.M | re.S,
)


def links(markdown: str) -> Iterator[re.Match[str]]:
    """Every link target in ``markdown`` (group ``target``), code blocks and spans left out."""
    for match in _TOKEN.finditer(markdown):
        if match.group("target") is not None:
            yield match


def relative_target(target: str) -> tuple[str, str] | None:
    """(path, '#anchor' or '') of a relative link; None for URLs, absolute or anchor-only links."""
    parts = urlsplit(target.strip("<>"))
    if parts.scheme or parts.netloc or not parts.path or parts.path.startswith("/"):
        return None
    return unquote(parts.path), f"#{parts.fragment}" if parts.fragment else ""


def _repo_root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def _outside_docs(source: Path, target: str, config: MkDocsConfig) -> Path | None:
    """The repository file outside docs/ that ``target``, linked from ``source``, names."""
    relative = relative_target(target)
    if relative is None:
        return None
    path = (source.parent / relative[0]).resolve()
    root, docs = _repo_root(config), Path(config.docs_dir).resolve()
    if not path.is_file() or not path.is_relative_to(root) or path.is_relative_to(docs):
        return None
    return path


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Adds every repository file a page links to (and those its Markdown links to)."""
    root = _repo_root(config)
    unread = [Path(f.abs_src_path) for f in files.documentation_pages() if f.abs_src_path]
    while unread:
        source = unread.pop()
        for match in links(source.read_text(encoding="utf-8")):
            path = _outside_docs(source, match.group("target"), config)
            if path is None:
                continue
            src_uri = posixpath.join(PREFIX, path.relative_to(root).as_posix())
            if files.get_file_from_path(src_uri) is None:
                files.append(File.generated(config, src_uri, abs_src_path=str(path)))
                if path.suffix == ".md":
                    unread.append(path)
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Points links to repository files at their copies in the site."""
    source = Path(page.file.abs_src_path or "")
    root, docs = _repo_root(config), Path(config.docs_dir).resolve()
    here = posixpath.dirname(page.file.src_uri)
    copied = page.file.src_uri.startswith(PREFIX + "/")  # a repository file's copy

    def site_target(target: str) -> str | None:
        relative = relative_target(target)
        if relative is None:
            return None
        path = (source.parent / relative[0]).resolve()
        if path.is_relative_to(docs):
            if not copied:  # a page of docs/ links to another as MkDocs expects
                return None
            src_uri = path.relative_to(docs).as_posix()
        elif _outside_docs(source, target, config) is not None:
            src_uri = posixpath.join(PREFIX, path.relative_to(root).as_posix())
        else:
            return None
        return posixpath.relpath(src_uri, here or ".") + relative[1]

    out, last = [], 0
    for match in links(markdown):
        new = site_target(match.group("target"))
        if new is not None:
            out += [markdown[last : match.start("target")], new]
            last = match.end("target")
    out.append(markdown[last:])
    text = "".join(out)
    if copied:
        path = page.file.src_uri.removeprefix(PREFIX + "/")
        text += f"\n\n---\n\n*This page is `{path}` in the repository.*\n"
    return text
