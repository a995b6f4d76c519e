"""Counted nouns in messages and labels: '1 step', '2 steps', '1 process', '2 processes'."""

from __future__ import annotations

__all__ = ["plural"]


def plural(count: int, noun: str) -> str:
    """'1 knot', '2 knots', '1 process', '2 processes'."""
    if count == 1:
        return f"{count} {noun}"
    return f"{count} {noun}es" if noun.endswith("s") else f"{count} {noun}s"
