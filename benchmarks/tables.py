"""Markdown tables for the benchmarks' results files: the library's one writer, re-exported here."""

from __future__ import annotations

from odeify.inspection.report import markdown_table

__all__ = ["markdown_table"]
