"""report.md: mean ± std over seeds of the selected learning rate, the learning-rate grid, a partial
sweep's progress, and the plots it links."""
from __future__ import annotations

import re

from posattn.synthetic.report import select_lr, write_plots, write_report


def cell(label, lr, seed, acc, selected, d_model=32, train_length=16):
    return {"label": label, "d_model": d_model, "train_length": train_length, "lr": lr, "seed": seed, "parameters": 100,
            "steps": 10, "train_seconds": 1.0, "valid_accuracy": acc,
            "accuracy": {str(train_length): acc, str(2 * train_length): acc / 2}, "not_applicable": {},
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
    assert "Accuracy vs width" not in report      # one width: the length table says it all


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


def grid_config(**extra):
    """Two training lengths × two widths × two models, 2 lrs × 2 seeds: 8 cells per model and length."""
    return {"name": "t", "task": "mqar", "task_params": {}, "vocab_size": 16, "train_length": [16, 32],
            "test_lengths": {"16": [16, 32], "32": [32, 64]}, "d_model": [32, 64], "seeds": [0, 1],
            "examples": {"train": 1, "valid": 1, "test": 1},
            "models": [{"label": "cat (1L)"}, {"label": "rope (2L)"}],
            "training": {"steps": 10, "batch_size": 4, "lr": [1e-3, 1e-2], "warmup": 0.1, "target_accuracy": 0.99},
            **extra}


def test_a_partial_sweep_says_which_cells_are_missing_and_skips_empty_panels(tmp_path):
    claims = [{"claim": "cat beats rope", "paper": "Fig 2", "holds": ["cat (1L) > rope (2L)"], "at": {}}]
    config = grid_config(claims=claims)
    # only the (16, 32) panel has cells: cat with 2 seeds at lr 1e-2, rope with one seed
    results = [cell("cat (1L)", 1e-2, s, a, False) for s, a in enumerate([0.9, 1.0])]
    results += [cell("cat (1L)", 1e-3, 0, 0.5, False), cell("rope (2L)", 1e-2, 0, 0.2, False)]
    select_lr(results)
    report = write_report(config, results, tmp_path, cells_total=32).read_text()
    assert "**Partial: 4 of 32 cells finished.**" in report
    assert "| model | trained 16, d 32 | trained 16, d 64 | trained 32, d 32 | trained 32, d 64 | in all |" in report
    assert "| cat (1L) | 3/4 | 0/4 | 0/4 | 0/4 | 3/16 |" in report
    assert "| rope (2L) | 1/4 | 0/4 | 0/4 | 0/4 | 1/16 |" in report
    assert "| all | 4/8 | 0/8 | 0/8 | 0/8 | 4/32 |" in report
    # a panel without cells is one line, not empty tables
    empty = report.split("## Accuracy vs test length (trained at 16, d_model 64)")[1].split("##")[0]
    assert empty.strip() == "No finished cell yet."
    assert "Accuracy vs width (trained and tested at 32)" not in report
    assert "## Accuracy vs width (trained and tested at 16)" in report
    # the unmeasured settings are named once, with the rows short of seeds
    row = next(line for line in report.splitlines() if line.startswith("| cat beats rope"))
    assert row.count("not measured") == 2 and row.endswith("**not measured** |")   # details once, verdict
    assert "not measured at 4 of 4 setting(s)" in row and "fewer than two seeds of cat (1L), rope (2L)" in row
    # a complete sweep has no progress table
    assert "in all |" not in write_report(config, results, tmp_path, cells_total=4).read_text()


def test_the_report_links_exactly_the_plots_it_writes(tmp_path):
    config = grid_config()
    results = [cell("cat (1L)", 1e-2, 0, 0.9, False), cell("rope (2L)", 1e-2, 0, 0.4, False, d_model=64),
               cell("cat (1L)", 1e-3, 1, 0.7, False, train_length=32)]
    select_lr(results)
    report = write_report(config, results, tmp_path, cells_total=32).read_text()
    written = {p.name for p in write_plots(config, results, tmp_path)}
    linked = set(re.findall(r"!\[[^\]]*\]\(([\w.-]+\.png)\)", report))
    assert linked == written == {"accuracy_vs_length_L16_d32.png", "accuracy_vs_length_L16_d64.png",
                                 "accuracy_vs_length_L32_d32.png", "accuracy_vs_width_L16.png",
                                 "accuracy_vs_width_L32.png"}
    assert all((tmp_path / name).stat().st_size > 1000 for name in written)


def test_one_test_length_per_panel_plots_width_only_and_an_empty_sweep_says_so_once(tmp_path):
    config = grid_config(test_lengths={"16": [16], "32": [32]})     # MQAR's layout: tested at the training length
    results = [cell("cat (1L)", 1e-2, 0, 0.9, False), cell("cat (1L)", 1e-2, 0, 0.8, False, d_model=64)]
    select_lr(results)
    report = write_report(config, results, tmp_path, cells_total=32).read_text()
    written = {p.name for p in write_plots(config, results, tmp_path)}
    assert written == {"accuracy_vs_width_L16.png"} and "](accuracy_vs_width_L16.png)" in report
    assert "accuracy_vs_length_" not in report
    empty = write_report(config, [], tmp_path, cells_total=32).read_text()
    assert "Partial: 0 of 32" in empty and empty.count("No finished cell yet") == 1
    assert "## Accuracy vs" not in empty and "| all | 0/8 | 0/8 | 0/8 | 0/8 | 0/32 |" in empty


def test_plots_draw_every_seed_beside_the_mean_so_a_bimodal_model_shows(tmp_path, monkeypatch):
    import matplotlib.figure

    from posattn.synthetic.report import PLOT_KEY, plot_series

    config = grid_config(test_lengths={"16": [16], "32": [32]})
    # rope: one seed solves the task and one does not, at both widths; cat solves it at d 32 only
    results = [cell("rope (2L)", 1e-2, 0, 1.0, False), cell("rope (2L)", 1e-2, 1, 0.0, False),
               cell("rope (2L)", 1e-2, 0, 0.9, False, d_model=64), cell("rope (2L)", 1e-2, 1, 0.1, False, d_model=64),
               cell("cat (1L)", 1e-2, 0, 1.0, False)]
    select_lr(results)
    series = plot_series(config, results, 16)
    assert series["rope (2L)"] == ([32, 64], [[1.0, 0.0], [0.9, 0.1]])
    assert series["cat (1L)"] == ([32, 64], [[1.0], []])

    drawn = {}
    save = matplotlib.figure.Figure.savefig

    def keep(fig, path, **kw):
        ax = fig.axes[0]
        drawn[path.name] = {
            "lines": {ln.get_label(): [round(float(y), 6) for y in ln.get_ydata()] for ln in ax.get_lines()
                      if not ln.get_label().startswith("_")},
            "dots": sorted(tuple(map(float, xy)) for c in ax.collections for xy in c.get_offsets())}
        return save(fig, path, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    write_plots(config, results, tmp_path)
    width = drawn["accuracy_vs_width_L16.png"]
    assert width["lines"]["rope (2L)"] == [0.5, 0.5]            # the mean alone hides the split ...
    assert width["lines"]["cat (1L)"][0] == 1.0
    assert width["dots"] == sorted([(32, 1.0), (32, 0.0), (64, 0.9), (64, 0.1), (32, 1.0)])  # ... the dots show it
    assert "cat (1L)" in width["lines"] and "rope (2L): no cell yet" not in width["lines"]
    report = write_report(config, results, tmp_path, cells_total=32).read_text()
    assert report.count(PLOT_KEY) == report.count("](accuracy_vs_") == 1
