"""Model configuration as data (a dataclass that round-trips through JSON and YAML)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..errors import PositionError


@dataclass
class ModelConfig:
    """Sizes, mechanisms and attention path of an :class:`Encoder` or :class:`Decoder`.

    ``mechanisms``: names or ``{"name": ..., **options}`` dicts, e.g. ``["cat", "tisa"]``.
    ``d_ff = 0`` builds blocks with no MLP (Zoology's synthetic-task models).
    ``init_std``: None keeps PyTorch's default init of linear maps; 0.02 is GPT-2's.
    """

    vocab_size: int = 1000
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None  # None: 4·d_model; 0: no MLP
    max_len: int = 512
    n_segments: int = 2
    mechanisms: list[Any] = field(default_factory=lambda: ["absolute"])
    dropout: float = 0.0
    attn_path: str = "fast"
    n_classes: int = 0
    bias: bool = True
    tie_embeddings: bool = True
    init_std: float | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len"):
            if int(getattr(self, name)) < 1:
                raise PositionError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise PositionError(f"ModelConfig: d_model {self.d_model} is not divisible by "
                                f"n_heads {self.n_heads}")
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        if isinstance(self.mechanisms, (str, dict)):
            self.mechanisms = [self.mechanisms]
        self.mechanisms = list(self.mechanisms)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise PositionError(f"ModelConfig: unknown field(s) {', '.join(unknown)}; valid fields: "
                                f"{', '.join(sorted(valid))}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
