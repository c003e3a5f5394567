"""Keys that every sweep config has (``claims:``, ``executor:``), as schema types with their checks,
for the schemas of :mod:`posattn.synthetic.schema` and :mod:`posattn.finetune.schema`."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field

from posattn.claims import parse_claims
from posattn.experiments.config import Shown, report
from posattn.experiments.executors import OPTIONS, block_problems


def _claims(claims: list | None) -> list | None:
    problems: list[str] = []
    parse_claims(claims, problems)
    report(problems)
    return claims


def _executor(block: dict | None) -> dict | None:
    report(block_problems(block))
    return block


# A list of papers' claims (posattn.claims), each {claim, paper, holds}.
Claims = Annotated[list[Any] | None, AfterValidator(_claims), Shown("[{claim, paper, holds}] | null")]

# Where a sweep's cells run (posattn.experiments.executors); command-line options win.
ExecutorBlock = Annotated[dict[str, Any] | None, AfterValidator(_executor), Shown("{key: value} | null")]


def executor_field() -> Any:
    """The ``executor:`` key of a sweep config."""
    return Field(None, description=f"where the cells run, with the keys {', '.join(OPTIONS)} (see Executors in "
                                   f"the command's --help); command-line options win")
