"""``--compile``: a training step through torch.compile gives eager's loss and gradients, for every
mechanism (dynamo capture + AOTAutograd, fp32 tolerance), and the three training loops train the
same weights compiled as eager."""
from __future__ import annotations

import copy

import pytest
import torch
from core.helpers import NAMES, dims, model, run, segments_for, tokens

from posattn.errors import PositionError
from posattn.mechanisms import runs_in_decoder
from posattn.runtime.compile import check_mode, compiled


def loss_of(m, ids, mask):
    return run(m, ids, mask).float().square().mean()


@pytest.mark.parametrize("name", NAMES)
def test_compiled_step_equals_eager_for_every_mechanism(name):
    causal = runs_in_decoder(name, dims(causal=True))
    eager = model(name, causal=causal, dtype=torch.float32, path="fast").train()
    fast = copy.deepcopy(eager)
    ids = tokens(2, 12)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, -3:] = False
    torch.manual_seed(0)
    a = loss_of(eager, ids, mask)
    a.backward()
    torch.manual_seed(0)
    b = compiled(loss_of, "dynamo")(fast, ids, mask)
    b.backward()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for (key, p), q in zip(eager.named_parameters(), fast.parameters()):
        if p.grad is None:
            assert q.grad is None, key
        else:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=key)


def one_graph(fn):
    """``fn`` through torch.compile with a backend that counts the graphs it is given and runs
    them eagerly. A host sync (``int(tensor)``, ``.tolist()``) splits a compiled function into
    several graphs there; ``fullgraph=True`` would not show it, since it captures such a value as
    a symbolic size instead (torch 2.13), which still syncs and keeps CUDA graphs off."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    graphs = CompileCounter()
    return torch.compile(fn, backend=graphs), graphs


@pytest.mark.parametrize("name", NAMES)
def test_training_step_is_one_graph(name):
    """No host sync splits a compiled step (CUDA graphs need one graph): the synthetic tasks'
    masked loss in a decoder, and an encoder's forward with segments, a padding mask and
    positions, each one graph and equal to eager."""
    from synthetic.test_train import data

    from posattn.synthetic.train import masked_loss, scored_bound

    if runs_in_decoder(name, dims(causal=True)):
        from synthetic.test_train import tiny

        m, d = tiny(name, 1), data(n=8)
        for most in (None, scored_bound(d)):  # every position's logits; the scored rows, a static count
            step, graphs = one_graph(masked_loss)
            torch.testing.assert_close(step(m, d.inputs, d.labels, most), masked_loss(m, d.inputs, d.labels),
                                       rtol=1e-5, atol=1e-6)
            assert graphs.frame_count == 1, f"the masked loss (scored_max={most}) split into {graphs.frame_count}"
    enc = model(name, causal=False, dtype=torch.float32, path="fast").train()
    ids = tokens(2, 12)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, -3:] = False
    seg, pos = segments_for(ids), torch.arange(12).expand(2, 12)

    def forward(ids, seg, mask, pos):
        return run(enc, ids, mask, seg, pos).float().square().mean()

    torch.manual_seed(0)
    a = forward(ids, seg, mask, pos)
    torch.manual_seed(0)
    step, graphs = one_graph(forward)
    b = step(ids, seg, mask, pos)
    assert graphs.frame_count == 1, f"the encoder's forward split into {graphs.frame_count} graphs"
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def landmark_step_compiles_once(device, backend="inductor"):
    """Landmark CAT (Fig 4) in a training step through torch.compile on ``device``: each (query,
    chosen block) pair reads its block by index inside the compiled step, so batches that choose
    other blocks compile nothing again, and the loss and gradients are eager's."""
    import copy

    from posattn.models import build_model
    from posattn.synthetic.generators import generate
    from posattn.synthetic.train import masked_loss, scored_bound

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = build_model({"kind": "decoder", "vocab_size": 32, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 0,
                         "max_len": 64, "mechanisms": [{"name": "landmark_cat", "block_size": 4}]}).to(device).train()
    comp = copy.deepcopy(eager)
    step = torch.compile(masked_loss, backend=backend)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for split in ("train", "valid"):  # other examples: 16 blocks a row, other ones chosen
            d = generate("mqar", 16, 64, 32, seed=0, split=split, num_kv_pairs=4)
            inputs, labels = d.inputs.to(device), d.labels.to(device)
            a, b = masked_loss(eager, inputs, labels), step(comp, inputs, labels, scored_bound(d))
            a.backward()
            b.backward()
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
            for (key, p), q in zip(eager.named_parameters(), comp.parameters()):
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=key)
                p.grad = q.grad = None


def test_compiled_landmark_step_compiles_once():
    """On the CPU through AOTAutograd without inductor's code generation (a minute of compiling
    on 2 cores), which the CUDA test runs."""
    landmark_step_compiles_once("cpu", "aot_eager")


def test_compiled_loss_at_a_static_count_of_scored_rows_equals_eager():
    """The compiled step's synthetic loss at ``scored_max`` rows per example (rows that score
    fewer padded with unscored ones, ignored) gives eager's loss and gradients; a bound below an
    example's count, or beyond the length, is one clear error."""
    from synthetic.test_train import data, tiny

    from posattn.synthetic.generators import IGNORE, TaskData
    from posattn.synthetic.train import masked_loss, scored_bound

    torch._dynamo.reset()
    d = data(n=4)
    labels = d.labels.clone()
    labels[1, (labels[1] != IGNORE).nonzero().flatten()[::2]] = IGNORE  # example 1 scores fewer than the others
    eager, comp = tiny("rope", 2), tiny("rope", 2)
    a = masked_loss(eager, d.inputs, labels)
    a.backward()
    most = scored_bound(TaskData(d.inputs, labels))
    assert most == int((d.labels[0] != IGNORE).sum()) > int((labels[1] != IGNORE).sum())
    b = torch.compile(masked_loss, backend="eager", fullgraph=True)(comp, d.inputs, labels, most)
    b.backward()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for (key, p), q in zip(eager.named_parameters(), comp.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=key)
    keep = labels != IGNORE
    with pytest.raises(PositionError, match="scored_max=1, but a row scores"):
        eager(d.inputs, scored=keep, scored_max=1)
    with pytest.raises(PositionError, match="scored_max must be between 0 and the length"):
        eager(d.inputs, scored=keep, scored_max=d.inputs.shape[1] + 1)


def test_synthetic_training_compiled_with_inductor_trains_eager_weights():
    from synthetic.test_train import data, tiny

    from posattn.synthetic.train import TrainConfig, train

    cfg = TrainConfig(steps=3, batch_size=8, lr=3e-3, eval_every=3, seed=1)
    eager, fast = tiny("rope", 1), tiny("rope", 1)
    a = train(eager, data(n=40), cfg, valid=data("valid", 16), progress=False)
    b = train(fast, data(n=40), cfg, valid=data("valid", 16), progress=False, compile="default")
    assert b.history[-1]["valid_accuracy"] == a.history[-1]["valid_accuracy"]
    assert b.loss == pytest.approx(a.loss, rel=1e-4)
    for (key, p), q in zip(eager.state_dict().items(), fast.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=key)


def test_bad_mode_is_one_clear_error():
    with pytest.raises(PositionError, match="--compile: mode 'fast' is not one of default, reduce-overhead"):
        check_mode("fast")
