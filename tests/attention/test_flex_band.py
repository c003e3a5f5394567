"""The band gradients of windowed captured terms (``flex_band``) equal autograd through dense
attention: the band products, the query-relative products' gradient slot by slot (the far sums in
the edge slots), a Toeplitz table's gradient as the parameters behind its clipped entries receive
it, with padded keys and causal rows; and ``flex_attend(band_grads=True)`` gives FlexAttention's own
gradients end to end. FlexAttention itself trains only on CUDA, so here its contract (scores through
``score_mod``, the block mask, the log-sum-exp) is computed densely; the CUDA test runs the whole
path through FlexAttention's kernels."""
from __future__ import annotations

import pytest
import torch

from posattn.attention.flex import _band_applies, _scorer
from posattn.attention.flex_band import Band, band_gradients, banded

B, H, N, D = 2, 3, 72, 8


def test_banded_products_are_the_band_of_the_full_product() -> None:
    g = torch.Generator().manual_seed(0)
    a, c = torch.randn(B, H, 300, D, generator=g), torch.randn(B, H, 300, D, generator=g)
    full = a @ c.transpose(-1, -2)
    for w in (0, 3, 70):
        got = banded(a, c, w)
        i = torch.arange(300)[:, None]
        j = i + torch.arange(-w, w + 1)
        want = torch.where((j >= 0) & (j < 300), full[..., i, j.clamp(0, 299)], 0.0)
        assert got.shape == (B, H, 300, 2 * w + 1) and torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_band_gradients_equal_autograd_through_dense_attention(causal: bool) -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    wt, wq = 5, 3
    beta = torch.randn(H, 2 * wt + 1, generator=g, requires_grad=True)      # T5 / fixed_conv: clipped
    r = torch.arange(-(N - 1), N)
    table = beta[:, r.clamp(-wt, wt) + wt]                                  # [h, 2N − 1], constant beyond ±wt
    prod = torch.randn(B, H, N, 2 * wq + 1, generator=g, requires_grad=True)  # q·W[r] of dynamic_conv
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, N - 7:] = False

    def mask_mod(bi: torch.Tensor, hi: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        ok = ki <= qi if causal else ki >= 0
        return ok & (keep[bi, ki] | (ki == qi))

    def attention(mod, region=None):  # dense: O and the log-sum-exp (−inf for rows with no key)
        bi, hi = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
        qi, ki = torch.arange(N)[:, None], torch.arange(N)[None]
        s = mod(q @ k.transpose(-1, -2), bi, hi, qi, ki)
        allowed = mask_mod(bi, hi, qi, ki) & (True if region is None else region(bi, hi, qi, ki))
        s = s.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.where(allowed, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]), 0.0)
        return p @ v, lse

    learned = _scorer(N, table, [], [(prod, wq)], [], [], [])
    o, lse = attention(learned)
    grad_o = torch.randn(B, H, N, D, generator=g)
    d_beta, d_prod = torch.autograd.grad((o * grad_o).sum(), [beta, prod], retain_graph=True)

    fixed = _scorer(N, table.detach(), [], [(prod.detach(), wq)], [], [], [])
    band = Band(fixed, mask_mod, [wq], wt, causal, lambda region: attention(fixed, region))
    (g_prod,), g_table = band_gradients(band, q, k, v, o.detach(), lse.detach(), grad_o)
    assert torch.allclose(g_prod, d_prod, atol=1e-5), (g_prod - d_prod).abs().max()
    (got_beta,) = torch.autograd.grad(table, beta, g_table)   # the clipped entries' parameters
    assert torch.allclose(got_beta, d_beta, atol=1e-5), (got_beta - d_beta).abs().max()
    if causal:   # no key to the right of the window: the far-right slot holds only offset +wq
        assert torch.all(g_table[:, N + wt] == 0)


def test_the_band_applies_only_where_it_gives_every_captured_gradient() -> None:
    n = 64
    learned = torch.zeros(1, 1, n, 7, requires_grad=True)
    fixed = torch.zeros(1, 1, n, 7)
    table = torch.zeros(1, 2 * n - 1, requires_grad=True)
    assert _band_applies(None, [(learned, 3)], [], [], [], [], n)
    assert _band_applies(table, [], [], [], [], [5], n)
    assert not _band_applies(table, [], [], [], [], [5, None], n)             # a table with no window (TISA)
    assert _band_applies(None, [(learned, 3)], [(learned, 3)], [], [], [], n)      # composite: both sides
    assert not _band_applies(None, [(learned, 3)], [], [torch.zeros(1, 1, n, n, requires_grad=True)], [], [], n)
    assert not _band_applies(None, [(learned, 3)], [], [], [(fixed[..., 0], learned[..., 0])], [], n)
    assert not _band_applies(None, [(fixed, 3)], [], [], [], [], n)           # nothing learns
    assert not _band_applies(None, [(learned, 20)], [], [], [], [], n)        # the band is most of the row
    with torch.no_grad():
        assert not _band_applies(None, [(learned, 3)], [], [], [], [], n)


def dense_flex(q, k, v, score_mod=None, block_mask=None, scale=None, kernel_options=None, return_aux=None):
    """FlexAttention's contract computed densely (scores through ``score_mod``, the block mask's
    ``mask_mod``, the log-sum-exp on request), differentiable on the CPU, where FlexAttention
    itself refuses a backward."""
    from torch.nn.attention.flex_attention import AuxOutput

    b, h, n, _ = q.shape
    bi, hi = torch.arange(b).view(b, 1, 1, 1), torch.arange(h).view(1, h, 1, 1)
    qi, ki = torch.arange(n)[:, None], torch.arange(n)[None]
    s = (q @ k.transpose(-1, -2)) * (1.0 if scale is None else scale)
    s = score_mod(s, bi, hi, qi, ki) if score_mod is not None else s
    if block_mask is not None:
        s = s.masked_fill(~block_mask.mask_mod(bi, hi, qi, ki), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    o = p @ v
    return (o, AuxOutput(lse=lse, max_scores=None)) if return_aux is not None else o


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_flex_attend_hands_the_band_gradients_to_the_captured_terms(causal: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``flex_attend(band_grads=True)`` end to end with FlexAttention's contract computed densely:
    the same output and the same gradients for q, k, v, a windowed table's parameters and the
    query- and key-relative weights (``composite``'s two sides) as FlexAttention's own
    differentiation through ``score_mod`` (padded length, padded keys), and the band is what gave
    the captured gradients."""
    import math

    from posattn.attention import flex as flex_module
    from posattn.attention import flex_band
    from posattn.attention.terms import QueryRelative, Toeplitz

    monkeypatch.setattr(flex_module, "_COMPILED", {"flex": dense_flex})
    calls: list[int] = []
    real = flex_band.band_gradients
    monkeypatch.setattr(flex_band, "band_gradients", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    n, wt, wq = 100, 6, 4     # padded to 128 inside
    g = torch.Generator().manual_seed(2)
    leaves = [torch.randn(B, H, n, D, generator=g).requires_grad_() for _ in range(3)]
    beta = torch.randn(H, 2 * wt + 1, generator=g).requires_grad_()
    weight = torch.randn(H, 2 * wq + 1, D, generator=g).requires_grad_()
    key_weight = torch.randn(2 * wq + 3, D, generator=g).requires_grad_()    # shared by the heads
    keep = torch.ones(B, n, dtype=torch.bool)
    keep[0, n - 11:] = False
    grad_o = torch.randn(B, H, n, D, generator=g)

    def run(band: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        q, k, v = leaves
        r = torch.arange(-(n - 1), n)
        terms = [Toeplitz(beta[:, r.clamp(-wt, wt) + wt], window=wt), QueryRelative(q, weight, wq, 0.5),
                 QueryRelative(k, key_weight, wq + 1, 0.5, key_side=True)]
        o = flex_module.flex_attend(q, k, v, [], terms, keep, causal, 1 / math.sqrt(D), band_grads=band)
        return o, list(torch.autograd.grad((o * grad_o).sum(), [*leaves, beta, weight, key_weight]))

    o_plain, g_plain = run(False)
    assert calls == []
    o_band, g_band = run(True)
    assert calls == [1]
    assert torch.allclose(o_band, o_plain, atol=1e-6)
    for name, got, want in zip(["q", "k", "v", "table", "weight", "key weight"], g_band, g_plain, strict=True):
        assert torch.allclose(got, want, atol=1e-5), (name, (got - want).abs().max())
