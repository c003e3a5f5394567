"""The fine-tuning loop: schedule, learning, resume bit-identical, weights loading, clear errors."""
import pytest
import torch

from posattn.errors import PositionError
from posattn.finetune.batches import encode_examples
from posattn.finetune.run import CHECKPOINT, FinetuneConfig, build_classifier, find_checkpoint, finetune, score
from posattn.finetune.tasks import GLUE, OFFLINE, Example
from posattn.models.io import read_config

from .helpers import SENTENCES, make_checkpoint, tokenizer

TASK = OFFLINE["sms_spam"]


def toy(n: int = 48):
    """The ten helper sentences in a shuffled order, each about n/10 times, labelled 1 for the three
    question or spam ones."""
    g = torch.Generator().manual_seed(n)
    picks = [i % len(SENTENCES) for i in torch.randperm(n, generator=g).tolist()]
    return encode_examples(tokenizer(), TASK, [Example(SENTENCES[i], None, int(i in (4, 5, 6))) for i in picks], 64)


def test_warmup_then_linear_decay():
    cfg = FinetuneConfig(lr=1.0, warmup=0.1)
    assert cfg.lr_at(0, 100) == pytest.approx(0.1) and cfg.lr_at(9, 100) == pytest.approx(1.0)
    assert cfg.lr_at(10, 100) == pytest.approx(1.0) and cfg.lr_at(55, 100) == pytest.approx(0.5)
    assert cfg.lr_at(99, 100) == pytest.approx(1 / 90)
    assert FinetuneConfig(epochs=3, batch_size=32).total_steps(100) == 10


def test_loads_pretrained_encoder_and_fresh_head(tmp_path):
    folder = find_checkpoint(make_checkpoint(tmp_path / "ck"))
    model = build_classifier(folder, GLUE["mnli"], dropout=0.1)
    assert model.cfg.n_classes == 3 and model.cfg.dropout == 0.1
    from posattn import load
    pre = load(folder).state_dict()
    for k, v in pre.items():
        assert torch.equal(model.state_dict()[k], v), k


def test_decoder_is_not_classification_capable(tmp_path):
    folder = make_checkpoint(tmp_path / "dec", kind="decoder")
    with pytest.raises(PositionError, match="'decoder' checkpoint is not classification-capable"):
        build_classifier(find_checkpoint(folder), TASK, 0.1)
    with pytest.raises(PositionError, match="not a posattn checkpoint"):
        find_checkpoint(tmp_path)


def test_learns_and_keeps_the_best_validation_weights():
    train, valid = toy(96), toy(40)
    torch.manual_seed(0)
    from posattn import Encoder, ModelConfig
    model = Encoder(ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=4, d_ff=64, max_len=64,
                                mechanisms=["none"], n_classes=2))
    before = score(model, TASK, valid, 16)["accuracy"]
    out = finetune(model, TASK, train, valid, FinetuneConfig(lr=3e-3, epochs=20, batch_size=16, evals_per_epoch=2,
                                                             dropout=0.0), progress=False)
    after = score(model, TASK, valid, 16)
    assert after["score"] == pytest.approx(out["valid_score"])            # the kept weights are the best ones
    assert out["valid_score"] == max(h["valid_score"] for h in out["history"])
    assert after["accuracy"] == 1.0 > before


def test_patience_stops_early():
    train, valid = toy(32), toy(16)
    model = build_model_none()
    out = finetune(model, TASK, train, valid, FinetuneConfig(lr=0.0, epochs=10, batch_size=16, patience=2),
                   progress=False)
    assert out["stopped_early"] and out["steps"] == 6        # evaluations at 2, 4, 6: no improvement after the first


def build_model_none(seed=0, dropout=0.1):
    from posattn import Encoder, ModelConfig
    torch.manual_seed(seed)
    return Encoder(ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_len=64,
                               mechanisms=["absolute"], n_classes=2, dropout=dropout))


class Interrupt:
    """Raise KeyboardInterrupt at the ``at``-th forward pass (counted at the token embedding)."""

    def __init__(self, model, at):
        self.calls, self.at = 0, at
        model.tokens.register_forward_pre_hook(self.hook)

    def hook(self, *_):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt


def test_resumed_run_ends_bit_identical(tmp_path):
    cfg = FinetuneConfig(lr=1e-3, epochs=3, batch_size=16, evals_per_epoch=2, seed=3)   # dropout 0.1: RNG matters
    train, valid = toy(40), toy(12)
    straight = build_model_none()
    ref = finetune(straight, TASK, train, valid, cfg, progress=False)
    broken = build_model_none()
    Interrupt(broken, at=7)           # forwards: steps 1-2, eval, steps 3-4, eval, step 5 (interrupted)
    with pytest.raises(KeyboardInterrupt):
        finetune(broken, TASK, train, valid, cfg, checkpoint_dir=tmp_path, progress=False)
    saved = torch.load(tmp_path / CHECKPOINT, weights_only=True)["loop"]
    assert saved["step"] == 4 and saved["seconds"] > 0 and saved["cpu_seconds"] > 0
    resumed = build_model_none(seed=99)          # another init: everything must come from the checkpoint
    out = finetune(resumed, TASK, train, valid, cfg, checkpoint_dir=tmp_path, progress=False)
    assert out["history"] == ref["history"] and out["steps"] == ref["steps"]
    assert out["earlier_seconds"] == (saved["seconds"], saved["cpu_seconds"])  # run_cell adds them to its times
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(PositionError,
                       match=r"different config \(lr: 0.001 -> 0.002; batch_size: 16 -> 32; "
                             r"evals_per_epoch: 2 -> 1; seed: 3 -> 0\)"):
        finetune(build_model_none(), TASK, train, valid, FinetuneConfig(lr=2e-3), checkpoint_dir=tmp_path,
                 progress=False)


def test_regression_head_for_stsb(tmp_path):
    folder = find_checkpoint(make_checkpoint(tmp_path / "ck"))
    model = build_classifier(folder, GLUE["stsb"], 0.0)
    assert model.cfg.n_classes == 1 and read_config(folder)["n_classes"] == 0
    examples = [Example(s, s, float(i % 5)) for i, s in enumerate(SENTENCES)]
    data = encode_examples(tokenizer(), GLUE["stsb"], examples, 64)
    out = finetune(model, GLUE["stsb"], data, data, FinetuneConfig(lr=1e-3, epochs=2, batch_size=4), progress=False)
    assert set(score(model, GLUE["stsb"], data, 4)) == {"pearson", "spearman", "score"}
    assert out["steps"] == 5   # ceil(2 epochs · 10 / 4)


def test_a_checkpoint_carrying_a_pickle_payload_is_refused_unrun(tmp_path):
    from runtime.payload import plant

    marker = tmp_path / "marker"
    path = plant(tmp_path / "cell", marker)
    before = path.read_bytes()
    with pytest.raises(PositionError, match="unreadable .*objects other than tensors and plain data"):
        finetune(build_model_none(), TASK, toy(16), toy(8), FinetuneConfig(epochs=1, batch_size=8),
                 checkpoint_dir=tmp_path / "cell", progress=False)
    assert not marker.exists() and path.read_bytes() == before


def test_a_locked_checkpoint_folder_is_refused(tmp_path):
    from runtime.holder import Holder

    with Holder(tmp_path / "cell") as pid:
        with pytest.raises(PositionError, match=f"is in use by another run \\(process {pid}\\)"):
            finetune(build_model_none(), TASK, toy(16), toy(8), FinetuneConfig(epochs=1, batch_size=8),
                     checkpoint_dir=tmp_path / "cell", progress=False)
        assert sorted(p.name for p in (tmp_path / "cell").iterdir()) == [".lock"]


def test_compiled_step_trains_the_eager_weights():
    """``compile='dynamo'``: the step through dynamo gives eager's history and weights (no dropout:
    inside a compiled step dropout draws from torch's generator, not the fused CPU kernels')."""
    cfg = FinetuneConfig(lr=1e-3, batch_size=8, epochs=1, evals_per_epoch=2, dropout=0.0)
    eager, fast = build_model_none(dropout=0.0), build_model_none(dropout=0.0)
    a = finetune(eager, TASK, toy(24), toy(12), cfg, progress=False)
    b = finetune(fast, TASK, toy(24), toy(12), cfg, progress=False, compile="dynamo")
    assert [r["valid_score"] for r in b["history"]] == [r["valid_score"] for r in a["history"]]
    assert b["history"][-1]["loss"] == pytest.approx(a["history"][-1]["loss"], rel=1e-5)
    for (key, p), q in zip(eager.state_dict().items(), fast.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=key)


def test_predictions_are_computed_with_subnormals_flushed_on_the_cpu():
    """Scoring outside the loop (a run's test sets, GLUE's table) runs flushed as training does
    (posattn.runtime.device.subnormals_flushed), and the caller's mode is back afterwards."""
    from runtime.floats import SUBNORMAL, modes_seen, times_one

    model = build_model_none()
    with modes_seen(model.tokens) as seen:
        score(model, TASK, toy(16), 8)
    assert seen == [0.0, 0.0]                      # two batches of eight
    assert times_one(SUBNORMAL) == pytest.approx(SUBNORMAL, rel=1e-3)
