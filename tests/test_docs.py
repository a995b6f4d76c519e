"""The docs' links resolve inside the repository: every relative link names a file that exists,
every #anchor a heading of that file, and nothing points outside the repository.

And every page of docs/ reads as a manual, not a measurement journal: it opens with a call (a code
block within its first lines), stays within about 300 lines, and names no targets, verdicts or
"what is left"; those live in benchmarks/results/ beside the figures they judge."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![image](target)
CODE_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose(path: Path) -> str:
    """The file's text without its fenced code blocks (a '#' comment there is not a heading)."""
    return CODE_BLOCK.sub("", path.read_text())


PAGES = sorted((ROOT / "docs").glob("*.md"))  # the manual; docs/demo/ holds a generated report
MAX_LINES = 300
CALL_WITHIN = 40  # lines: the page's first code block, after what it covers
JOURNAL_HEADING = re.compile(r"\btargets?\b|what is left|\bto[- ]?do\b", re.IGNORECASE)
JOURNAL_PHRASE = re.compile(
    r"what is left|\bto-do\b|\btodo\b"  # a to-do list
    r"|\btargets?\b(?:[^.|\n]|\n(?!\s*\n)){0,80}?\b(?:met|missed)\b"  # a verdict: "target ... met"
    r"|\btargets? ?[:(]",  # a target stated: "Target: ...", "Targets (ALF <= 0.6x ...)"
    re.IGNORECASE,
)


def journal_faults(text: str) -> list[str]:
    """Why ``text`` reads as a measurement journal rather than a manual (empty if it does not)."""
    faults = []
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        faults.append(f"{len(lines)} lines, over {MAX_LINES}: split it or move measurements out")
    if not any(line.startswith("```") for line in lines[:CALL_WITHIN]):
        faults.append(f"no code block in its first {CALL_WITHIN} lines: open with a call that works")
    text_prose = CODE_BLOCK.sub("", text)
    faults += [
        f"heading {h!r}" for h in text_prose.splitlines() if h.startswith("#") and JOURNAL_HEADING.search(h)
    ]
    faults += [f"phrase {m.group(0)!r}" for m in JOURNAL_PHRASE.finditer(text_prose)]
    return faults


def anchors(path: Path) -> set[str]:
    return {github_slug(line.lstrip("#")) for line in prose(path).splitlines() if line.startswith("#")}


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path)) if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto:


def test_github_slug_matches_githubs_rule() -> None:
    assert github_slug("6. Left limits at a step's end") == "6-left-limits-at-a-steps-end"
    assert github_slug("`reversible` (bit-exact)") == "reversible-bit-exact"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(doc: Path) -> None:
    broken = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {linked.name}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_page_reads_as_a_manual(page: Path) -> None:
    """Targets, verdicts and to-do lists go to benchmarks/results/ (a *_notes.md file there)."""
    faults = journal_faults(page.read_text())
    assert not faults, f"{page.relative_to(ROOT)}: " + "; ".join(faults)


def test_a_journal_page_is_caught() -> None:
    """The check can fail: each mark of a journal is reported, and a manual passes."""
    manual = "# Calibration\n\nFits a stage to its source.\n\n```python\nodeify.calibrate(m, data)\n```\n"
    assert journal_faults(manual) == []
    assert journal_faults(manual + "\nretarget(model, knots=2); its target the source's activation.\n") == []
    journal = manual + (
        "\n## Targets and what is left\n\n- Within 2 points: met on the ResNets.\n"
        "- Target: ALF <= 1.5x. The time target\n  is met on resnet50.\n- a to-do\n"
    )
    assert journal_faults(journal) == [
        "heading '## Targets and what is left'",
        "phrase 'what is left'",
        "phrase 'Target:'",
        "phrase 'target\\n  is met'",
        "phrase 'to-do'",
    ]
    assert journal_faults("# Page\n\nNo call.\n") == [
        f"no code block in its first {CALL_WITHIN} lines: open with a call that works"
    ]
    assert journal_faults(manual + "line\n" * MAX_LINES)[0].startswith(
        f"{len(manual.splitlines()) + MAX_LINES} lines"
    )
