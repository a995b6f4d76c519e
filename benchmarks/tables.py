"""Tables for the benchmarks: the results file's markdown (the library's one writer, re-exported),
the one layout of a results file around its table, and the same rows on the terminal."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

from machine import provenance
from rich.console import Console
from rich.table import Table

from odeify.inspection.report import markdown_table

__all__ = ["bullets", "markdown_table", "print_table", "results_document"]


def bullets(title: str, items: Iterable[str]) -> list[str]:
    """A titled bullet list of a results file (the targets and their verdicts, failures), with the
    blank lines around it."""
    return [title, "", *(f"- {item}" for item in items), ""]


def results_document(
    prose: Sequence[str],
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    command: str,
    *,
    text_columns: int = 2,
    after: Sequence[str] = (),
) -> str:
    """A results file: its title and prose lines, one table, the lines ``after`` it (a verdict),
    then the command that wrote it and the machine it ran on."""
    table = markdown_table(headers, rows, text_columns=text_columns)
    return "\n".join([*prose, "", *table, "", *([*after, ""] if after else []), *provenance(command)])


def print_table(
    title: str,
    caption: str,
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    text_columns: int,
    width: int,
) -> None:
    """The rows on the terminal as a rich table: the first ``text_columns`` left-aligned, numbers
    right; ``width`` where stdout is not a terminal (a log file keeps whole rows)."""
    table = Table(title=title, caption=caption)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i < text_columns else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=None if sys.stdout.isatty() else width).print(table)
