"""The front page stays a front page, and its headline numbers are the results files' numbers.

README.md is what a newcomer reads: at most about 150 lines and 15 KB; the measurement log lives in
benchmarks/results/. Each row of its "Results at a glance" table links the file its figures come
from, and every number in the row's result cell must appear in that file, so a rerun that changes a
figure cannot leave the front page quoting the old one. User-facing text names no tracker issue and
no "today".
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
USER_FACING = sorted([README, *(ROOT / "docs").rglob("*.md")])
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[-+]?\d+)?x?")


def headline_rows() -> list[tuple[str, str, Path]]:
    """(what, result, linked file) for each row of the README's results table."""
    text = README.read_text().split("## Results at a glance", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        link = re.search(r"\]\(([^)]+)\)", cells[-1]) if len(cells) == 3 else None
        if link:
            rows.append((cells[0], cells[1], ROOT / link.group(1)))
    return rows


def test_readme_is_a_front_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150 and len(text.encode()) <= 15_000
    rows = headline_rows()
    assert 3 <= len(rows) <= 8
    assert all(len(result.split()) <= 15 for _, result, _ in rows), "a headline cell over 15 words"


@pytest.mark.parametrize("row", headline_rows(), ids=lambda r: r[0])
def test_headline_numbers_are_the_results_files(row: tuple[str, str, Path]) -> None:
    what, result, source = row
    assert source.is_file(), f"{what}: {source} does not exist"
    quoted = source.read_text()
    missing = [n for n in NUMBER.findall(result) if n not in quoted]
    assert not missing, f"{what}: {missing} not in {source.relative_to(ROOT)}"


def test_a_changed_figure_is_caught(tmp_path: Path) -> None:
    """The check can fail: a figure the file does not hold is reported."""
    results = tmp_path / "r.md"
    results.write_text("ratio 0.98x, error 4.6e-07")
    assert [n for n in NUMBER.findall("0.97x and 4.6e-07") if n not in results.read_text()] == ["0.97x"]


@pytest.mark.parametrize("doc", USER_FACING, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_facing_text_names_no_issue_and_no_today(doc: Path) -> None:
    text = doc.read_text()
    found = re.findall(r"\bissues? \d+|\btoday\b", text, flags=re.IGNORECASE)
    assert not found, f"{doc.relative_to(ROOT)}: {found}"


def _rendered(markdown: str) -> str:
    """HTML as a CommonMark renderer with GitHub's tables draws it (markdown-it-py, rich's parser)."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table").render(markdown)


def test_readme_renders_its_picture_outside_the_table() -> None:
    """A line right after a table is one more row of it in GitHub's rendering: the picture must not be."""
    html = _rendered(README.read_text())
    tables = "".join(re.findall(r"<table>.*?</table>", html, flags=re.S))
    assert "<img" in html and "<img" not in tables
    assert "<img" in "".join(
        re.findall(r"<table>.*?</table>", _rendered("| a |\n|---|\n| b |\n![p](p.png)"), re.S)
    )


def test_every_results_file_is_indexed() -> None:
    """benchmarks/results/README.md is the index of the measurements: no results file goes unlisted."""
    results = ROOT / "benchmarks" / "results"
    index = (results / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+)\)", index))
    files = {p.name for p in results.iterdir() if p.suffix in (".md", ".png") and p.name != "README.md"}
    assert {f for f in files if f.endswith(".md")} - linked == set(), "results files not in the index"
    assert {name for name in linked if not name.startswith("../")} <= files, "the index links a missing file"
