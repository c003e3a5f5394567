"""The GPU path: on CUDA the fast path equals the reference path (outputs and gradients) for every
mechanism, encoder and decoder, with padding; skipped on a machine without CUDA."""
from __future__ import annotations

import pytest
import torch

import posattn
from posattn.attention import fast
from posattn.mechanisms import REGISTRY
from posattn.models import Decoder, Encoder, ModelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SINGLE = [n for n in posattn.names() if not getattr(REGISTRY[n], "mixes", False)]


def outputs_and_grads(model, ids, keep):
    model.zero_grad(set_to_none=True)
    h = model(ids, attention_mask=keep) if model.causal else model(ids, None, keep)
    w = torch.randn(h.shape, generator=torch.Generator(h.device).manual_seed(0), device=h.device)
    (h * w * keep[..., None]).sum().backward()
    return h.detach(), {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("name", SINGLE)
def test_fast_equals_reference_on_cuda(name, causal):
    check_fast_against_reference(name, causal)


@pytest.mark.parametrize("name", ["dynamic_conv", "key_dynamic_conv", "composite", "deberta", "transformer_xl"])
def test_skewed_relative_bias_equals_reference_on_cuda(name):
    """The dense bias path with query/key-relative terms built by skewing (the GPU command's A/B
    arm), instead of FlexAttention."""
    with fast.using(fast.policy_for(torch.device("cuda"), use_flex=False, relative_bias="skew")):
        check_fast_against_reference(name, False)


def test_flex_formula_equals_reference_on_cuda():
    """ALiBi's bias computed per score in FlexAttention (``Policy.flex_formula``, the GPU command's
    A/B arm), outputs and gradients."""
    with fast.using(fast.policy_for(torch.device("cuda"), flex_formula=True)):
        check_fast_against_reference("alibi", False)


@pytest.mark.parametrize("name", ["alibi", "t5", "dynamic_conv"])
def test_flex_tma_equals_reference_on_cuda(name):
    """FlexAttention's kernels with the Tensor Memory Accelerator (``Policy.flex_tma``, the GPU
    command's A/B arm): a fixed table, a learned one and query/key-relative products, outputs and
    gradients."""
    with fast.using(fast.policy_for(torch.device("cuda"), flex_tma=True)):
        check_fast_against_reference(name, False)


def test_flex_autotune_equals_reference_on_cuda():
    """FlexAttention compiled with max-autotune-no-cudagraphs (``Policy.flex_autotune``, the GPU
    command's A/B arm), a learned table, outputs and gradients."""
    with fast.using(fast.policy_for(torch.device("cuda"), flex_autotune=True)):
        check_fast_against_reference("t5", False)


@pytest.mark.parametrize("name", ["cat", "depthwise_conv", "conv_qkv"])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_compiled_convolutions_equal_reference_on_cuda(name, causal):
    """The short depthwise convolutions through torch.compile (``Policy.compiled_conv``, the GPU
    command's A/B arm)."""
    with fast.using(fast.policy_for(torch.device("cuda"), compiled_conv=True)):
        check_fast_against_reference(name, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_compiled_blocks_equal_reference_on_cuda(causal, monkeypatch):
    """Landmark CAT's picked blocks read by index through torch.compile (``Policy.compiled_blocks``,
    the GPU command's A/B arm), and that compiled function is the one that ran."""
    from posattn.mechanisms import landmark

    calls = []
    real = landmark.compiled_attend_blocks
    monkeypatch.setattr(landmark, "compiled_attend_blocks", lambda: calls.append(1) or real())
    with fast.using(fast.policy_for(torch.device("cuda"), compiled_blocks=True)):
        check_fast_against_reference("landmark_cat", causal)
    assert calls


@pytest.mark.parametrize(("name", "path"), [("t5", "flex"), ("alibi", "sdpa")])
def test_compiled_flex_step_is_one_graph_on_cuda(name, path, monkeypatch):
    """CAT Fig 2's attention baselines on their CUDA path in a whole training step through
    torch.compile, as ``compare --compile`` runs them: one graph (``fullgraph``), eager's loss and
    gradients, and no unfused FlexAttention call, in the step or in the eager evaluation after it
    (the GPU command's CAT stage logged "flex_attention called without torch.compile"). T5 runs in
    FlexAttention with its table (padded to the block) read in ``score_mod``; causal ALiBi is low
    rank and folds into SDPA's q and k."""
    import copy
    import warnings

    from synthetic.test_train import data, tiny

    from posattn.synthetic.train import evaluate, masked_loss, scored_bound

    torch._dynamo.reset()
    eager = tiny(name, 2).cuda().train()
    comp = copy.deepcopy(eager)
    d = data(n=16)
    inputs, labels = d.inputs.cuda(), d.labels.cuda()
    paths, real_plan = [], fast.plan
    monkeypatch.setattr(fast, "plan", lambda *a, **kw: paths.append(real_plan(*a, **kw)) or paths[-1])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        a = masked_loss(eager, inputs, labels)
        a.backward()
        monkeypatch.setattr(fast, "plan", real_plan)
        assert set(paths) == {path}, paths
        b = torch.compile(masked_loss, fullgraph=True)(comp, inputs, labels, scored_bound(d))
        b.backward()
        evaluate(comp, data("test", 64))
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    for (key, p), q in zip(eager.named_parameters(), comp.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=key)
    assert not [w for w in seen if "without torch.compile" in str(w.message)], [str(w.message) for w in seen]


def test_compiled_landmark_step_compiles_once_on_cuda():
    """Landmark CAT (Fig 4) through inductor on CUDA: eager's loss and gradients, one compile for
    batches that choose other blocks."""
    from runtime.test_compile import landmark_step_compiles_once

    landmark_step_compiles_once("cuda")


def test_profile_ranks_cuda_kernels():
    from posattn.bench.profile import step_profile

    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)

    def step():
        (x @ x).sum().backward()

    step()
    prof = step_profile(step, "cuda", top=3)
    assert prof["clock"] == "cuda kernels" and prof["total_ms"] > 0 and prof["kernels"]
    assert prof["ops"][0]["name"] in ("aten::mm", "aten::matmul") and prof["ops"][0]["share"] > 0.5


def check_fast_against_reference(name, causal):
    if causal and name in ("segment", "tupe"):
        pytest.skip("encoder mechanism")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, max_len=96, mechanisms=[name],
                      attn_path="reference")
    try:
        ref = (Decoder if causal else Encoder)(cfg).cuda()
    except posattn.PositionError as e:
        pytest.skip(str(e))
    fast = (Decoder if causal else Encoder)(ModelConfig(**{**cfg.to_dict(), "attn_path": "fast"})).cuda()
    fast.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 50, (3, 96), device="cuda")
    keep = torch.ones(3, 96, dtype=torch.bool, device="cuda")
    keep[1, 70:] = False
    h_ref, g_ref = outputs_and_grads(ref, ids, keep)
    h_fast, g_fast = outputs_and_grads(fast, ids, keep)
    real = keep
    assert torch.allclose(h_ref[real], h_fast[real], atol=2e-4, rtol=1e-3)
    assert g_ref.keys() == g_fast.keys()
    for n in g_ref:
        scale = 1 + g_ref[n].abs().max()
        assert (g_ref[n] - g_fast[n]).abs().max() <= 5e-4 * scale, n


@pytest.mark.parametrize("backend", ["flash", "cudnn"])
def test_sdpa_backend_takes_that_kernel_on_cuda(backend):
    """``Policy.sdpa_backend`` on CUDA (the GPU layer target's baseline is FlashAttention-backed
    SDPA, where PyTorch's own choice was cuDNN's): the plain-SDPA layer's bf16 training step
    dispatches that kernel and no other."""
    from posattn.bench.cases import BASELINE, CaseSpec, Sizes, layer_case

    sizes = Sizes(device="cuda", dtype="bfloat16", batch=2, max_len=256)
    policy = fast.policy_for(torch.device("cuda"), sdpa_backend=backend)
    with fast.using(policy):
        case = layer_case(CaseSpec("layer", BASELINE, 256), sizes, record=False)
        with torch.profiler.profile() as prof:
            case.train()
    ops = {e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")}
    assert ops and all(backend in name for name in ops), ops
