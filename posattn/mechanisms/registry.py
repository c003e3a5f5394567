"""Name -> mechanism class. Mechanism modules register themselves with :func:`register`."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ..errors import PositionError

if TYPE_CHECKING:
    from .base import Mechanism

REGISTRY: dict[str, type[Mechanism]] = {}
M = TypeVar("M", bound=type["Mechanism"])


def register(name: str) -> Callable[[M], M]:
    """Class decorator: make a mechanism available under ``name``."""

    def deco(cls: M) -> M:
        if name in REGISTRY:
            raise PositionError(f"mechanism name {name!r} registered twice")
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return deco


def get(name: str) -> type[Mechanism]:
    """Look a mechanism up by name; unknown names list the valid ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise PositionError(
            f"unknown mechanism {name!r}; valid mechanisms: {', '.join(names())}"
        ) from None


def names() -> list[str]:
    """All registered mechanism names, in registration order."""
    return list(REGISTRY)
