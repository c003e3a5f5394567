import numpy as np
import pytest
import torch

from posattn.analysis.toeplitz import (
    adjacent_cosine,
    diagonal_means,
    gram,
    toeplitz_fit,
    toeplitz_from_profile,
    toeplitz_r2,
)
from posattn.mechanisms.absolute import sinusoids


def test_exact_toeplitz_has_r2_one():
    rng = np.random.default_rng(0)
    a = toeplitz_from_profile(rng.normal(size=2 * 40 - 1))
    assert toeplitz_r2(a) == pytest.approx(1.0, abs=1e-12)
    assert np.allclose(toeplitz_fit(a), a)


def test_random_matrix_has_low_r2():
    a = np.random.default_rng(1).normal(size=(64, 64))
    # diagonals explain ~ (2n − 1)/n² of the variance by chance
    assert toeplitz_r2(a) < 0.06


def test_r2_hand_computed_and_batched():
    a = np.array([[1.0, 2.0], [4.0, 3.0]])
    # diagonals: r=−1 {4}, r=0 {1, 3} (mean 2), r=1 {2}; RSS = 2, TSS = 5
    assert diagonal_means(a).tolist() == [4.0, 2.0, 2.0]
    assert toeplitz_r2(a) == pytest.approx(1 - 2 / 5)
    batch = np.stack([a, toeplitz_from_profile([1.0, 2.0, 3.0])])
    assert np.allclose(toeplitz_r2(batch), [0.6, 1.0])


def test_constant_matrix_is_toeplitz_and_bad_shapes_refused():
    assert toeplitz_r2(np.full((5, 5), 3.0)) == 1.0
    with pytest.raises(ValueError, match="square"):
        toeplitz_r2(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="non-finite"):
        toeplitz_r2(np.array([[np.nan, 0.0], [0.0, 1.0]]))


def test_sinusoids_give_exactly_toeplitz_gram_and_smooth_cosines():
    e = sinusoids(torch.arange(50), 16).double().numpy()
    assert toeplitz_r2(gram(e)) == pytest.approx(1.0, abs=1e-6)
    assert adjacent_cosine(e).min() > 0.5
