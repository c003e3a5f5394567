"""``none``: no position information at all, the bag-of-words baseline (Chang et al. 2021, Table 1).

    s_ij = q_i·k_j / √d_h

Without position the layer is permutation equivariant.
"""
from .base import Mechanism
from .registry import register


@register("none")
class NoPosition(Mechanism):
    """No position information: s_ij = q_i·k_j/√d_h, the bag-of-words baseline (Chang et al. 2021,
    Table 1). The layer is permutation equivariant. No options."""

    paper = "Chang et al. 2021, Table 1 (no position baseline)"
    equation = "s_ij = q_i·k_j/√d_h"

    def start_at_zero(self) -> bool:
        """Adds nothing, ever."""
        return True
