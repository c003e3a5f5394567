"""report.md: mean ± std over seeds of the selected learning rate, and the learning-rate grid."""
from __future__ import annotations

from posattn.synthetic.report import write_report


def cell(label, lr, seed, acc, selected):
    return {"label": label, "d_model": 32, "train_length": 16, "lr": lr, "seed": seed, "parameters": 100,
            "steps": 10, "train_seconds": 1.0, "accuracy": {"16": acc, "32": acc / 2}, "not_applicable": {},
            "selected": selected}


def test_report_shows_mean_std_over_seeds_and_the_lr_grid(tmp_path):
    config = {"name": "t", "task": "mqar", "task_params": {}, "vocab_size": 16, "train_length": [16],
              "test_lengths": {"16": [16, 32]}, "d_model": [32], "seeds": [0, 1],
              "examples": {"train": 1, "valid": 1, "test": 1},
              "models": [{"label": "cat (1L)"}, {"label": "rope (2L)"}],
              "training": {"steps": 10, "batch_size": 4, "lr": [1e-3, 1e-2], "warmup": 0.1, "target_accuracy": 0.99}}
    results = [cell("cat (1L)", 1e-3, 0, 0.5, False), cell("cat (1L)", 1e-3, 1, 0.7, False),
               cell("cat (1L)", 1e-2, 0, 0.9, True), cell("cat (1L)", 1e-2, 1, 1.0, True),
               cell("rope (2L)", 1e-3, 0, 0.2, True), cell("rope (2L)", 1e-2, 0, 0.1, False)]
    report = write_report(config, results, tmp_path, cells_total=8).read_text()
    assert "**Partial: 6 of 8 cells finished.**" in report      # rope's seed 1 is missing
    assert "| cat (1L) | 100 | 0.01 | 10/10 | 1 | 0.950 ± 0.071 | 0.475 ± 0.035 |" in report
    assert "| rope (2L) | 100 | 0.001 | 10 | 1 | 0.200 | 0.100 |" in report  # one seed: no std
    assert "| model | lr 0.001 | lr 0.01 |" in report
    assert "| cat (1L) | 0.600 ± 0.141 | 0.950 ± 0.071 |" in report
    assert "| model | d=32 |" in report and "| cat (1L) | 0.950 ± 0.071 |" in report


def test_claims_are_judged_at_every_setting_they_cover(tmp_path):
    config = {"name": "t", "task": "mqar", "task_params": {}, "vocab_size": 16, "train_length": [16],
              "test_lengths": {"16": [16, 32]}, "d_model": [32], "seeds": [0, 1, 2],
              "examples": {"train": 1, "valid": 1, "test": 1},
              "models": [{"label": "cat (1L)"}, {"label": "rope (2L)"}],
              "training": {"steps": 10, "batch_size": 4, "lr": [1e-2], "warmup": 0.1, "target_accuracy": 0.99},
              "claims": [
                  {"claim": "cat beats rope", "paper": "Fig 2", "holds": ["cat (1L) > rope (2L)"], "at": {}},
                  {"claim": "cat solves it at the longest length", "paper": "Fig 1",
                   "holds": ["cat (1L) >= 0.99"], "at": {"length": "longest"}},
                  {"claim": "never measured", "paper": "-", "holds": ["cat (1L) > rope (2L)"], "at": {"length": 64}}]}
    results = [cell("cat (1L)", 1e-2, s, a, True) for s, a in enumerate([0.98, 1.0, 0.99])]
    results += [cell("rope (2L)", 1e-2, s, a, True) for s, a in enumerate([0.50, 0.52, 0.48])]
    report = write_report(config, results, tmp_path, cells_total=6).read_text()
    section = report.split("## The paper's claims")[1]
    rows = {line.split(" | ")[0].strip("| "): line for line in section.splitlines() if line.startswith("| ")}
    assert "d=32, trained 16, tested 16: cat (1L) − rope (2L) = +0.49" in rows["cat beats rope"]
    assert rows["cat beats rope"].endswith("| **reproduced** |")
    # at 32 the accuracies are halved (0.49-0.5): far below 0.99
    assert "tested 32" in rows["cat solves it at the longest length"]
    assert rows["cat solves it at the longest length"].endswith("| **not reproduced** |")
    never = rows["never measured"]
    assert "no setting of this sweep" in never and never.endswith("**not measured** |")
