"""DIET Theorem 1: input-absolute scores never exceed rank d_h; DIET-ABS does where it can."""
import numpy as np
import torch

from posattn.analysis.native import position_scores, score_matrices64
from posattn.analysis.rank import numerical_rank, theorem1_construction
from posattn.analysis.reports import random_pair
from posattn.models import build_model


def test_theorem_construction():
    for n, d, d_h, d_p in [(16, 8, 4, 4), (20, 10, 3, 12), (12, 6, 2, 10)]:
        a_a, a_r = theorem1_construction(n, d, d_h, d_p)
        assert numerical_rank(a_a) <= d_h
        assert numerical_rank(a_r) == d_h + d_p > d_h


def test_numerical_rank_batched_and_tolerance():
    m = np.random.default_rng(0).normal(size=(3, 10, 4)) @ np.random.default_rng(1).normal(size=(3, 4, 10))
    assert numerical_rank(m).tolist() == [4, 4, 4]
    assert numerical_rank(np.diag([1.0, 1e-3, 1e-9]), rtol=1e-6) == 2


def test_diet_abs_exceeds_head_dim_and_absolute_never():
    pair = random_pair(d_model=16, n_heads=4, n_layers=2, max_len=24)  # d_h = 4 = d_p
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    ranks = {k: np.stack([numerical_rank(s.numpy()) for s in score_matrices64(m, ids)]) for k, m in pair.items()}
    assert ranks["absolute"].max() <= 4
    assert (ranks["diet_abs"] == 8).all()  # d_h + d_p, generic weights
    pos = {k: [numerical_rank(p.numpy()) for p in position_scores(m, 24)] for k, m in pair.items()}
    assert max(np.max(r) for r in pos["absolute"]) <= 4  # P W_Q W_Kᵀ Pᵀ
    assert all((np.asarray(r) == 4).all() for r in pos["diet_abs"])  # P_Q P_Kᵀ, rank d_p


def test_rank_bound_holds_on_short_inputs_and_for_a_wide_diet_abs():
    m = build_model({"kind": "encoder", "vocab_size": 50, "d_model": 16, "n_heads": 4, "n_layers": 1,
                     "max_len": 10, "mechanisms": [{"name": "diet_abs", "rank": 16}]})
    ids = torch.randint(0, 50, (1, 10), generator=torch.Generator().manual_seed(0))
    assert numerical_rank(score_matrices64(m, ids)[0].numpy()).tolist() == [[10, 10, 10, 10]]  # min(n, d_h + d_p)
