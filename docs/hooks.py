"""MkDocs hook: the site follows the docs' links to the repository's other files.

The pages under ``docs/`` link files outside it by relative paths (``../ARCHITECTURE.md``,
``../bench/results/t1-dpa1/README.md``), which GitHub resolves as they are. MkDocs cannot: such a file is
not part of the site, and ``mkdocs build --strict`` fails on the link. So this hook mirrors every file
outside ``docs/`` that a page links into the site under ``repo/<path>`` (Markdown files as pages, any
other file as a download), follows the mirrored pages' own links the same way, and rewrites each such
link to its mirror. A link to a folder goes to the folder's ``README.md``; a folder without one cannot
be shown, so that link becomes its text. A link to a missing file is left as written, for MkDocs to
report. ``mkdocs.yml`` names this file under ``hooks:`` and leaves it out of the pages.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

MIRROR = "repo"  # the site folder the mirrored files go to
FENCE = re.compile(r"^\s*(```|~~~)")
# an inline code span (kept as it is), or an inline link or image: [text](target "title")
LINK = re.compile(
    r"(?P<code>(`+).+?\2)"
    r"|(?P<bang>!?)\[(?P<text>[^\]]*)\]\((?P<target><[^>]*>|[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)",
    re.DOTALL,
)

_mirrored: dict[str, Path] = {}  # src_uri under MIRROR -> the repository file it copies


def outside_code(markdown: str, edit: Callable[[str], str]) -> str:
    """``markdown`` with ``edit`` applied to each run of lines outside fenced code blocks."""
    out: list[str] = []
    prose: list[str] = []
    fence: str | None = None
    for line in markdown.splitlines(keepends=True):
        match = FENCE.match(line)
        if fence is None and match is None:
            prose.append(line)
            continue
        if prose:
            out.append(edit("".join(prose)))
            prose = []
        out.append(line)
        if fence is None and match is not None:
            fence = match.group(1)
        elif fence is not None and line.strip().startswith(fence) and line.strip().strip(fence[0]) == "":
            fence = None
    if prose:
        out.append(edit("".join(prose)))
    return "".join(out)


def is_relative(target: str) -> bool:
    """Whether a link target is a path inside the repository (not a URL, an anchor or an absolute path)."""
    return not (target.startswith(("#", "/")) or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target))


def link_targets(markdown: str) -> list[str]:
    """The relative link targets of ``markdown`` outside code, each with its anchor (``path#anchor``)."""
    found: list[str] = []

    def collect(text: str) -> str:
        for match in LINK.finditer(text):
            target = (match.group("target") or "").strip("<>")
            if target and is_relative(target):
                found.append(target)
        return text

    outside_code(markdown, collect)
    return found


def _resolve(origin: Path, target: str, root: Path) -> Path | None:
    """The file a link from ``origin`` reaches inside ``root`` (for a folder, its README.md), or None."""
    path = (origin.parent / target).resolve()
    if path.is_dir():
        path = path / "README.md"
    if not path.is_file() or root not in path.parents:
        return None
    return path


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Mirror every file outside docs_dir that a page, or a mirrored page, links to."""
    root = Path(config.config_file_path).resolve().parent
    docs = Path(config.docs_dir).resolve()
    _mirrored.clear()
    queue = [Path(f.abs_src_path) for f in files.documentation_pages() if f.abs_src_path]
    seen: set[Path] = set()
    while queue:
        page = queue.pop()
        if page in seen:
            continue
        seen.add(page)
        for target in link_targets(page.read_text(encoding="utf-8")):
            path = _resolve(page, target.partition("#")[0], root) if not target.startswith("#") else None
            if path is None or docs in path.parents:
                continue
            src_uri = posixpath.join(MIRROR, path.relative_to(root).as_posix())
            if src_uri not in _mirrored:
                _mirrored[src_uri] = path
                files.append(File.generated(config, src_uri, abs_src_path=str(path),
                                            inclusion=InclusionLevel.NOT_IN_NAV))
                if path.suffix == ".md":
                    queue.append(path)
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Point the page's links that leave docs_dir at their mirrors (relative to the page)."""
    root = Path(config.config_file_path).resolve().parent
    docs = Path(config.docs_dir).resolve()
    src_uri = page.file.src_uri
    mirrored = src_uri in _mirrored
    origin = _mirrored[src_uri] if mirrored else docs / src_uri
    here = posixpath.dirname(src_uri) or "."

    def rewrite(match: re.Match[str]) -> str:
        if match.group("code"):
            return match.group(0)
        target = match.group("target").strip("<>")
        path_part, _, anchor = target.partition("#")
        if not is_relative(target) or not path_part:
            return match.group(0)
        path = _resolve(origin, path_part, root)
        if path is None:
            folder = (origin.parent / path_part).resolve()
            if folder.is_dir() and root in folder.parents:
                return match.group("text")  # a folder without a README: nothing to show on the site
            return match.group(0)  # missing: MkDocs reports it
        if docs in path.parents:
            if not mirrored:
                return match.group(0)  # a docs page's own link: MkDocs resolves it
            new = posixpath.relpath(path.relative_to(docs).as_posix(), here)
        else:
            new = posixpath.relpath(posixpath.join(MIRROR, path.relative_to(root).as_posix()), here)
        suffix = f"#{anchor}" if anchor else ""
        return f"{match.group('bang')}[{match.group('text')}]({new}{suffix}{match.group('title') or ''})"

    return outside_code(markdown, lambda text: LINK.sub(rewrite, text))
