"""The training loop: learning, determinism, checkpoint/resume, schedule."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from posattn.errors import PositionError
from posattn.models import build_model
from posattn.runtime.checkpoint import CHECKPOINT
from posattn.synthetic.generators import generate
from posattn.synthetic.train import TrainConfig, evaluate, train

V, L = 16, 16


def tiny(mechanism: str = "cat", layers: int = 1, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model({"kind": "decoder", "vocab_size": V, "d_model": 32, "n_layers": layers, "n_heads": 2,
                        "d_ff": 0, "max_len": 64, "mechanisms": [mechanism]})


def data(split: str = "train", n: int = 2000):
    return generate("mqar", n, L, V, seed=0, split=split, num_kv_pairs=2)


def test_tiny_run_learns_well_above_chance() -> None:
    """Two pairs, values from 8 tokens: chance is 1/8; one CAT layer gets most queries right."""
    model = tiny()
    before = evaluate(model, data("test", 300))
    result = train(model, data(), TrainConfig(steps=300, batch_size=32, lr=1e-2, eval_every=50,
                                             target_accuracy=0.95), valid=data("valid", 200), progress=False)
    after = evaluate(model, data("test", 300))
    assert before < 0.3 and after > 0.8, (before, after, result.history)
    assert result.history and result.history[-1]["valid_accuracy"] == result.valid_accuracy


def test_early_stop_at_target_accuracy() -> None:
    result = train(tiny(), data(), TrainConfig(steps=400, batch_size=32, lr=1e-2, eval_every=10,
                                              target_accuracy=0.5), valid=data("valid", 200), progress=False)
    assert result.stopped_early and result.steps < 400 and result.valid_accuracy >= 0.5


class Interrupt(nn.Module):
    """Wraps a model and raises KeyboardInterrupt at the given training forward call."""

    def __init__(self, model: nn.Module, at: int) -> None:
        super().__init__()
        self.model, self.at, self.calls = model, at, 0

    def forward(self, x: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                raise KeyboardInterrupt
        return self.model(x, scored=scored)


def test_resumed_run_ends_bit_identical(tmp_path: Path) -> None:
    cfg = TrainConfig(steps=30, batch_size=16, lr=3e-3, eval_every=7, seed=4)
    train_data, valid = data(n=100), data("valid", 50)   # 100 examples: batches wrap across epochs
    straight = tiny("rope", 2)
    ref = train(straight, train_data, cfg, valid=valid, progress=False)

    with pytest.raises(KeyboardInterrupt):
        train(Interrupt(tiny("rope", 2), at=17), train_data, cfg, valid=valid, checkpoint_dir=tmp_path,
              progress=False)
    saved = torch.load(tmp_path / CHECKPOINT, weights_only=True)["loop"]
    assert saved["step"] == 14 and saved["seconds"] > 0
    resumed = Interrupt(tiny("rope", 2, seed=99), at=0)   # another init: all must come from the checkpoint
    out = train(resumed, train_data, cfg, valid=valid, checkpoint_dir=tmp_path, progress=False)

    assert out.steps == ref.steps == 30 and out.history == ref.history
    assert out.seconds > saved["seconds"]       # wall time adds up over the interrupted and resumed parts
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    again = train(Interrupt(tiny("rope", 2), at=1), train_data, cfg, valid=valid, checkpoint_dir=tmp_path,
                  progress=False)
    assert again.steps == 30 and again.history == ref.history   # a finished run is not trained again


def test_checkpoint_of_another_config_is_refused(tmp_path: Path) -> None:
    cfg = TrainConfig(steps=2, batch_size=8, eval_every=1)
    train(tiny(), data(n=50), cfg, checkpoint_dir=tmp_path, progress=False)
    with pytest.raises(PositionError, match=r"different config \(steps: 2 -> 3; eval_every: 1 -> 100\)"):
        train(tiny(), data(n=50), TrainConfig(steps=3, batch_size=8), checkpoint_dir=tmp_path, progress=False)


def test_warmup_then_cosine_schedule() -> None:
    cfg = TrainConfig(steps=100, lr=1.0, warmup=0.1, min_lr_ratio=0.1)
    assert cfg.warmup_steps == 10
    assert cfg.lr_at(0) == pytest.approx(0.1) and cfg.lr_at(9) == pytest.approx(1.0)
    assert cfg.lr_at(10) == pytest.approx(1.0) and cfg.lr_at(55) == pytest.approx(0.55)
    assert cfg.lr_at(99) > 0.1 and cfg.lr_at(100) == pytest.approx(0.1)
    assert TrainConfig(steps=100, warmup=5).warmup_steps == 5


def test_divergence_is_reported() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1))

        def forward(self, x: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
            return torch.full((int(scored.sum()), V), float("nan")) * self.w

    with pytest.raises(FloatingPointError, match="lower the learning rate"):
        train(Broken(), data(n=20), TrainConfig(steps=3, batch_size=4), device="cpu", progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_run_resumes_from_a_checkpoint(tmp_path: Path) -> None:
    cfg = TrainConfig(steps=10, batch_size=8, eval_every=5)
    model = tiny()
    with pytest.raises(KeyboardInterrupt):
        train(Interrupt(model, at=8), data(n=64), cfg, checkpoint_dir=tmp_path, device="cuda", progress=False)
    resumed = Interrupt(tiny(), at=0)
    out = train(resumed, data(n=64), cfg, valid=data("valid", 32), checkpoint_dir=tmp_path, device="cuda",
                progress=False)
    assert out.steps == 10 and next(resumed.parameters()).is_cuda


def test_a_cell_checkpoint_carrying_a_pickle_payload_is_refused_unrun(tmp_path: Path) -> None:
    """A ``checkpoint.pt`` copied into a compare cell folder is read as tensors and plain data only:
    one PositionError, the payload never runs, nothing is written over the file."""
    from runtime.payload import plant

    from posattn.synthetic.compare import run_cell, validate_config

    sweep = validate_config({"task": "mqar", "task_params": {"num_kv_pairs": 2}, "vocab_size": V, "train_length": L,
                             "test_lengths": [L], "examples": {"train": 40, "valid": 8, "test": 8}, "d_model": 16,
                             "models": [{"mechanisms": ["rope"], "layers": 1}],
                             "training": {"steps": 2, "batch_size": 4}})
    cell, marker = sweep.cells[0], tmp_path / "marker"
    path = plant(tmp_path / "cells" / cell.id, marker)
    before = path.read_bytes()
    with pytest.raises(PositionError, match="unreadable .*objects other than tensors and plain data"):
        run_cell(cell, [L], tmp_path, progress=False)
    assert not marker.exists() and path.read_bytes() == before
    assert not (tmp_path / "cells" / cell.id / "result.json").exists()


def test_a_locked_cell_folder_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """Another process holds the cell folder: the loop and the compare cell each get one
    PositionError naming it, and write nothing there."""
    from runtime.holder import Holder

    from posattn.synthetic.compare import run_cell, validate_config

    sweep = validate_config({"task": "mqar", "task_params": {"num_kv_pairs": 2}, "vocab_size": V, "train_length": L,
                             "test_lengths": [L], "examples": {"train": 40, "valid": 8, "test": 8}, "d_model": 16,
                             "models": [{"mechanisms": ["rope"], "layers": 1}],
                             "training": {"steps": 2, "batch_size": 4}})
    folder = tmp_path / "cells" / sweep.cells[0].id
    with Holder(folder) as pid:
        with pytest.raises(PositionError, match=f"is in use by another run \\(process {pid}\\)"):
            train(tiny(), data(n=20), TrainConfig(steps=2, batch_size=4), checkpoint_dir=folder, progress=False)
        with pytest.raises(PositionError, match=f"{sweep.cells[0].id} is in use by another run \\(process {pid}\\)"):
            run_cell(sweep.cells[0], [L], tmp_path, progress=False)
        assert sorted(p.name for p in folder.iterdir()) == [".lock"]


def test_a_compare_cell_evaluates_with_subnormals_flushed_on_the_cpu(tmp_path: Path, monkeypatch) -> None:
    """The test lengths are scored after the loop has ended, in the same flushed mode as training
    (posattn.runtime.device.subnormals_flushed), and the caller's mode is back afterwards."""
    from runtime.floats import SUBNORMAL, modes_seen, times_one

    import posattn.synthetic.compare as compare

    modes, accuracies = [], []
    real = compare.evaluate

    def scored(model, test, batch_size):
        with modes_seen(model) as seen:
            accuracies.append(real(model, test, batch_size))
        modes.extend(seen)
        return accuracies[-1]

    monkeypatch.setattr(compare, "evaluate", scored)
    sweep = compare.validate_config({"task": "mqar", "task_params": {"num_kv_pairs": 2}, "vocab_size": V,
                                     "train_length": L, "test_lengths": [L], "d_model": 16,
                                     "examples": {"train": 40, "valid": 8, "test": 8},
                                     "models": [{"mechanisms": ["rope"], "layers": 1}],
                                     "training": {"steps": 2, "batch_size": 4}})
    result = compare.run_cell(sweep.cells[0], [L], tmp_path, device="cpu", progress=False)
    assert modes == [0.0] and result["accuracy"] == {str(L): accuracies[0]}
    assert times_one(SUBNORMAL) == pytest.approx(SUBNORMAL, rel=1e-3)
