import numpy as np
import pytest
import torch

from posattn.analysis.reports import build_tisa_model
from posattn.analysis.tisa_fit import fit_tisa, tisa_function
from posattn.analysis.toeplitz import toeplitz_from_profile
from posattn.models import build_model

FAST = dict(restarts=4, adam_steps=300, lbfgs_steps=300)


def synthetic(n, a, b, c, offset):
    r = torch.arange(-(n - 1), n, dtype=torch.float64)
    prof = tisa_function(r, torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                         torch.tensor(c, dtype=torch.float64)) + offset
    return toeplitz_from_profile(prof.numpy())


def test_fit_recovers_known_kernels():
    truth = [([2.0, -1.0], [0.5, 0.02], [-1.0, 3.0], 0.7), ([1.5, 0.8], [1.0, 0.1], [1.0, -4.0], -0.3)]
    mats = np.stack([synthetic(48, *t) for t in truth])
    fit = fit_tisa(mats, n_kernels=2, **FAST)
    for h, (a, b, c, o) in enumerate(truth):
        order = np.argsort(fit.c[h])
        want = np.argsort(c)
        assert np.allclose(fit.a[h][order], np.array(a)[want], atol=1e-4)
        assert np.allclose(fit.b[h][order], np.array(b)[want], atol=1e-4)
        assert np.allclose(fit.c[h][order], np.array(c)[want], atol=1e-3)
        assert fit.offset[h] == pytest.approx(o, abs=1e-4)
    assert (fit.r2 > 0.999999).all() and (fit.matrix_r2 > 0.999999).all() and (fit.rmse < 1e-4).all()


def test_noise_lowers_matrix_r2_but_not_the_profile_fit():
    rng = np.random.default_rng(0)
    mats = synthetic(32, [1.0], [0.3], [0.0], 0.0)[None] + 0.3 * rng.normal(size=(1, 32, 32))
    fit = fit_tisa(mats, n_kernels=1, **FAST)
    assert fit.matrix_r2[0] < 0.6 < fit.r2[0]
    with pytest.raises(ValueError, match="window"):
        fit_tisa(mats, window=40)


def test_tisa_model_built_from_the_fit_scores_like_the_fit():
    src = build_model({"kind": "encoder", "vocab_size": 30, "d_model": 16, "n_heads": 2, "n_layers": 2,
                       "max_len": 24, "mechanisms": ["absolute"]})
    mats = np.stack([np.stack([synthetic(24, [1.0 + h, -0.5], [0.4, 0.05], [h - 1.0, 2.0], 0.0)
                               for h in range(2)]) for _ in range(2)])
    fit = fit_tisa(mats, n_kernels=2, **FAST)
    model = build_tisa_model(src, fit)
    assert [m if isinstance(m, str) else m["name"] for m in model.cfg.mechanisms] == ["tisa"]
    assert torch.equal(model.tokens.weight, src.tokens.weight)  # non-positional weights copied
    r = np.arange(-23, 24)
    for layer, block in enumerate(model.blocks):
        tisa = block.attn.mechanisms[0]
        assert np.allclose(tisa.table(24).detach().numpy(), fit.function(r)[layer], atol=1e-5)
