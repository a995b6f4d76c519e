"""Markdown tables for the benchmarks' results files: one writer for all scripts."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[str]], text_columns: int = 2) -> list[str]:
    """Lines of a markdown table; the first ``text_columns`` columns left-aligned, the rest right."""
    rule = "|".join("---" if i < text_columns else "---:" for i in range(len(headers)))
    return [
        "| " + " | ".join(headers) + " |",
        f"|{rule}|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
