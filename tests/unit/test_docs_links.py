"""Every relative link in the repository's Markdown resolves: the file it names exists, and
its ``#anchor`` is a heading of that file (GitHub's anchors), so a section moved or renamed
in one document fails here rather than leaving another pointing at nothing."""

from __future__ import annotations

import re
from functools import cache
from itertools import pairwise
from pathlib import Path
from urllib.parse import unquote

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

ROOT = Path(__file__).resolve().parents[2]
MARKDOWN = MarkdownIt("commonmark").enable("table")


def documents(root: Path) -> list[Path]:
    """Every ``*.md`` under ``root``, outside hidden folders (.venv, .git, .sift) and builds."""
    return sorted(
        p
        for p in root.rglob("*.md")
        if not any(part.startswith(".") or part.endswith(".egg-info") for part in p.parts)
    )


def _inline_text(token: Token) -> str:
    """A heading's text as rendered: its words and code spans, without the markup."""
    return "".join(c.content for c in token.children or [] if c.type in ("text", "code_inline"))


@cache
def anchors(path: Path) -> frozenset[str]:
    """The ``#anchor`` of each heading of ``path``, numbered ``-1``, ``-2`` when repeated."""
    tokens = MARKDOWN.parse(path.read_text())
    seen: dict[str, int] = {}
    found = set()
    for opening, inline in pairwise(tokens):
        if opening.type == "heading_open":
            base = re.sub(r"[^\w\- ]", "", _inline_text(inline).lower()).replace(" ", "-")
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


def links(path: Path) -> list[str]:
    """Each link and image target in ``path``'s text (not in code)."""
    found = []
    for token in MARKDOWN.parse(path.read_text()):
        for child in token.children or []:
            target = child.attrGet("href") if child.type == "link_open" else child.attrGet("src")
            if isinstance(target, str):
                found.append(target)
    return found


def broken_links(path: Path, root: Path) -> list[str]:
    """The relative links of ``path`` that name a missing file or a missing anchor."""
    broken = []
    for target in links(path):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("/"):
            continue  # a URL (checked by no test here) or an absolute path
        name, _, anchor = target.partition("#")
        linked = (path.parent / unquote(name)).resolve() if name else path
        if not linked.exists() or not linked.is_relative_to(root.resolve()):
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and unquote(anchor) not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor")
    return broken


@pytest.mark.parametrize("document", [str(p.relative_to(ROOT)) for p in documents(ROOT)])
def test_every_relative_link_resolves(document: str) -> None:
    assert broken_links(ROOT / document, ROOT) == []


def test_the_readme_and_docs_are_checked_and_link_to_each_other() -> None:
    checked = {str(p.relative_to(ROOT)) for p in documents(ROOT)}
    assert {"README.md", "deploy/README.md", "benchmarks/README.md"} <= checked
    assert any(t.startswith("docs/") and "#" in t for t in links(ROOT / "README.md"))


def test_a_missing_file_or_anchor_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n## Fusion weights: `sift eval --tune`\n\n## Limits\n\n### Limits\n\n"
        "```bash\n# not a heading\n```\n"
    )
    (tmp_path / "README.md").write_text(
        "# R\n\n"
        "[ok](docs/a.md#fusion-weights-sift-eval---tune) [ok](docs/a.md#limits-1) [ok](#r)\n"
        "| a | b |\n|---|---|\n| [in a table](docs/a.md#nope) | x |\n\n"
        "[gone](docs/b.md) [no anchor](docs/a.md#limits-2) [code](docs/a.md#not-a-heading)\n"
        "[a link\nover two lines](#missing) [web](https://example.com/x#y)\n"
    )
    assert broken_links(tmp_path / "README.md", tmp_path) == [
        "docs/a.md#nope: no heading with that anchor",
        "docs/b.md: no such file",
        "docs/a.md#limits-2: no heading with that anchor",
        "docs/a.md#not-a-heading: no heading with that anchor",
        "#missing: no heading with that anchor",
    ]


def test_every_docs_file_the_code_names_exists() -> None:
    """A comment, docstring or message that sends the reader to ``docs/NAME.md`` names a file
    that is there."""
    named = {
        (str(path.relative_to(ROOT)), name)
        for folder in ("worker", "api_gateway", "tests", "benchmarks")
        for path in (ROOT / folder).rglob("*.py")
        if path != Path(__file__)  # its made-up tree names made-up files
        for name in re.findall(r"\bdocs/[\w-]+\.md\b", path.read_text())
    }
    assert named, "no docs/ file named in the code"
    assert [(path, name) for path, name in named if not (ROOT / name).is_file()] == []
