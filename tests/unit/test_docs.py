"""The documents: README.md short and linking every page of docs/, every relative link and anchor
resolving, and no development history in the product (counters of development steps, issue
numbers) outside CHANGELOG.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 300

# Where the product speaks: code, tests, programs, the systemd files and the documents.
PRODUCT = ("elasticd", "tests", "agents", "systemd", "docs", "README.md")
# A counter of development steps (the word "stop" and a number), an issue of this project ("issue"
# and a number), and the phrases that date a rule by them. Another project's issue is cited by its
# address. The examples below are split in the source, so that a grep of the product finds none.
HISTORY = re.compile(r"\b[Ss]tops? \d+\b|\b[Ii]ssues? #?\d+\b|\bsince (?:stop|issue)\b")

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def product_files() -> list[Path]:
    out: list[Path] = []
    for name in PRODUCT:
        path = ROOT / name
        if path.is_file():
            out.append(path)
            continue
        out += [
            p
            for p in sorted(path.rglob("*"))
            if p.is_file() and p.suffix in (".py", ".md", ".sh", ".toml", ".example", ".service", ".txt")
        ]
    return [p for p in out if "__pycache__" not in p.parts and p != Path(__file__).resolve()]  # not the guard


def markdown_files() -> list[Path]:
    return [
        README,
        ROOT / "CHANGELOG.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "systemd").rglob("*.md")),
    ]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            base = slug(line.lstrip("#"))
            name, n = base, 1
            while name in out:
                name, n = f"{base}-{n}", n + 1
            out.add(name)
    return out


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def test_the_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; at most {MAX_README_LINES} (the rest goes to docs/)"


def test_the_readme_links_every_page_of_docs() -> None:
    linked = {
        (README.parent / target.split("#")[0]).resolve()
        for target in links(README)
        if not target.startswith(("http://", "https://", "mailto:"))
    }
    pages = sorted((ROOT / "docs").rglob("*.md"))
    assert pages
    missing = [str(p.relative_to(ROOT)) for p in pages if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_no_development_history_in_the_product() -> None:
    found = []
    for path in product_files():
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not found, "development history (it belongs in git log and CHANGELOG.md):\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("line", "flagged"),
    [
        ("since st" + "op 24 the coordinator", True),
        ("(iss" + "ue 13, item 4)", True),
        ("St" + "op 19's chaos run", True),
        ("see issues #12", True),
        ("the worker stops after 3 s", False),
        ("github.com/systemd/systemd/issues/18142", False),
        ("stop the agent", False),
    ],
)
def test_the_history_pattern(line: str, flagged: bool) -> None:
    assert bool(HISTORY.search(line)) is flagged
