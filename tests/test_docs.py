"""Everything the documentation and the code cite is in the repository.

* Every relative link of every Markdown file in the checkout (README, docs/, ARCHITECTURE.md,
  CONTRIBUTING.md, bench/**/README.md, ...) reaches an existing file, and a ``#heading`` in it where it
  names one (GitHub's anchors, which the docs site uses too: mkdocs.yml).
* Every ``docs/<page>.md`` a source file or a document cites exists, and so does the section it names
  (``docs/methods.md section 2.4``).
* Every repository path the front door and the manual quote (``training/local/regime.py``) exists.
* No file outside ``.ci/``, ``tests/`` and the Makefile names the development machines' shared folder
  beside the checkout: a clone has none.

"The checkout" is what git tracks plus new files it does not ignore, so the test sees a change before
it is committed. ``make docs`` (``mkdocs build --strict``) checks the rendered site on top of this.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^\s*(```|~~~)")
# an inline code span, or an inline link / image: [text](target "title")
LINK = re.compile(r"(?P<code>(`+).+?\2)|!?\[[^\]]*\]\((?P<target><[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\)", re.DOTALL)
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(?P<target><[^>]*>|\S+)", re.MULTILINE)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(?P<text>.+?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=\"(?P<id>[^\"]+)\"")
DOC_CITATION = re.compile(r"(?<![\w./-])docs/(?P<page>[\w./-]+?\.md)(?:#(?P<anchor>[\w-]+))?"
                          r"(?:,?\s+(?:section|§)\s*(?P<section>\d+(?:\.\d+)*))?")
# a backticked path under one of the repository's folders: `training/local/regime.py`, `bench/serving/`
QUOTED_PATH = re.compile(r"`(?P<path>(?:adapters|models|routing|training|serving|fedmosaic|demos|tests|bench"
                         r"|scripts|docs|\.ci)/[\w./-]*)`")
SHARED = "../" + "shared"  # spelled in two parts so that this file does not name it itself
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".txt", ".sh", ".cfg", ".ini", ".json", ".jsonl", ".html",
                 ".js", ".css", ".in", ""}


def checkout_files() -> list[Path]:
    """Files git tracks, plus untracked ones it does not ignore (relative to the repository root)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return sorted({Path(p) for p in out.decode().split("\0") if p and (ROOT / p).is_file()})


def markdown_files() -> list[Path]:
    return [p for p in checkout_files() if p.suffix == ".md"]


def outside_code(markdown: str) -> str:
    """``markdown`` without its fenced code blocks (their lines blanked, so line numbers hold)."""
    out, fence = [], None
    for line in markdown.splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def link_targets(markdown: str) -> list[str]:
    """Every link target outside code: inline links, images and reference definitions."""
    prose = outside_code(markdown)
    found = [m.group("target") for m in LINK.finditer(prose) if m.group("target")]
    found += [m.group("target") for m in REFERENCE.finditer(prose)]
    return [t.strip("<>") for t in found]


def is_relative(target: str) -> bool:
    return not (target.startswith("/") or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target))


def slug(text: str) -> str:
    """GitHub's anchor for a heading (pymdownx.slugs.slugify(case="lower") makes the same on the site)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors a Markdown file offers: its headings' slugs (GitHub numbers repeats) and HTML ids."""
    text = path.read_text(encoding="utf-8")
    counts: Counter[str] = Counter()
    found: set[str] = set()
    for line in outside_code(text).splitlines():
        match = HEADING.match(line)
        if match:
            base = slug(match.group("text"))
            found.add(base if counts[base] == 0 else f"{base}-{counts[base]}")
            counts[base] += 1
    found.update(m.group("id") for m in HTML_ANCHOR.finditer(text))
    return found


def test_every_relative_link_in_the_markdown_files_resolves() -> None:
    problems = []
    for rel in markdown_files():
        source = ROOT / rel
        for target in link_targets(source.read_text(encoding="utf-8")):
            if not is_relative(target):
                continue
            path_part, _, anchor = target.partition("#")
            path = (source.parent / path_part).resolve() if path_part else source
            if ROOT != path and ROOT not in path.parents:
                problems.append(f"{rel}: {target} leaves the repository")
            elif not path.exists():
                problems.append(f"{rel}: {target} does not exist")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                problems.append(f"{rel}: {target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)


def section_exists(page: Path, section: str) -> bool:
    """Whether ``page`` has a heading numbered ``section`` ("2.4" matches "### 2.4 Instance-wise ...")."""
    pattern = re.compile(rf"^ {{0,3}}#{{1,6}}\s+{re.escape(section)}\.?(\s|$)")
    return any(pattern.match(line) for line in outside_code(page.read_text(encoding="utf-8")).splitlines())


def test_every_cited_docs_page_and_section_exists() -> None:
    problems = []
    for rel in checkout_files():
        if rel.suffix not in TEXT_SUFFIXES or rel.parts[0] == "docs" and rel.name == "hooks.py":
            continue
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for match in DOC_CITATION.finditer(text):
            page = ROOT / "docs" / match.group("page")
            where = f"{rel}: docs/{match.group('page')}"
            if not page.is_file():
                problems.append(f"{where} does not exist")
            elif match.group("anchor") and match.group("anchor") not in anchors(page):
                problems.append(f"{where}#{match.group('anchor')}: no such heading")
            elif match.group("section") and not section_exists(page, match.group("section")):
                problems.append(f"{where} section {match.group('section')}: no such section")
    assert not problems, "\n".join(problems)


def test_every_repository_path_the_manual_quotes_exists() -> None:
    manual = [p for p in markdown_files() if p.parts[0] == "docs" or p.name in ("README.md", "CONTRIBUTING.md")
              and len(p.parts) == 1]
    assert Path("README.md") in manual and any(p.parts[0] == "docs" for p in manual)
    problems = []
    for rel in manual:
        for match in QUOTED_PATH.finditer(outside_code((ROOT / rel).read_text(encoding="utf-8"))):
            path = match.group("path")
            if not (ROOT / path.rstrip("/")).exists():
                problems.append(f"{rel}: `{path}` does not exist")
    assert not problems, "\n".join(problems)


def test_no_file_outside_ci_tests_and_the_makefile_names_the_shared_folder() -> None:
    offenders = []
    for rel in checkout_files():
        if rel.parts[0] in (".ci", "tests") or rel == Path("Makefile"):
            continue
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        lines = [n for n, line in enumerate(text.splitlines(), 1) if SHARED in line]
        offenders += [f"{rel}:{n}" for n in lines]
    assert not offenders, f"these name {SHARED}, which a clone does not have:\n" + "\n".join(offenders)


def test_the_slugs_are_githubs() -> None:
    assert slug("6. Discrepancies / gotchas worth deciding") == "6-discrepancies--gotchas-worth-deciding"
    assert slug("The paper's ablations") == "the-papers-ablations"
    assert slug("1.2 AMoLE routing — equations (4)–(11)") == "12-amole-routing--equations-411"
    assert slug("[0.1.0]") == "010"


def test_the_readme_is_a_front_door() -> None:
    """README.md stays short and says what and how: no issue numbers, commit hashes or dates (CONTRIBUTING.md)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    prose = outside_code(text)
    history = re.findall(r"(?i)\bissues? #?\d+|#\d+\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"
                         r"|\b20\d\d-\d\d-\d\d\b", prose)
    assert not history, history
