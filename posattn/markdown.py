"""Markdown for the commands' ``report.md`` files."""
from __future__ import annotations


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines (header, rule, one line per row) and a blank line after it."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows), ""]
