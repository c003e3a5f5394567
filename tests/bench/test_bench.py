"""``posattn bench`` runs end to end at tiny sizes and writes what it promises. Timings are
never asserted (they belong to the benchmark itself), only the shape of the results."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from posattn.bench.cases import CaseSpec, Sizes, make_case, parse_mechanisms, spec_label
from posattn.bench.measure import measure_memory, memory_supported
from posattn.bench.records import MODEL_TARGETS
from posattn.bench.report import GRID_TARGETS, TRAIN_TARGETS, targets
from posattn.cli import main
from posattn.mechanisms.conv import SHIFT_MAX

TINY = ["--quick", "--threads", "1", "--repeats", "1", "--warmup", "0"]


def run_cli(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "out"
    assert main(["bench", *TINY, "--out", str(out), *args]) == 0
    return json.loads((out / "bench.json").read_text())


def test_bench_rows_table_plot_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_cli(tmp_path, "-m", "t5", "dynamic_conv", "cat+tisa", "absolute", "--no-memory")
    text = capsys.readouterr().out
    assert "train ×" in text and "t5" in text
    for name in ("bench.txt", "bench.json", "bench.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    keys = {(r["mechanism"], r["kind"], r["n"]) for r in rows}
    for n in (64, 128):
        for kind in ("layer", "op"):
            assert ("sdpa", kind, n) in keys and ("t5", kind, n) in keys and ("cat+tisa", kind, n) in keys
        assert ("absolute", "layer", n) in keys and ("absolute", "op", n) not in keys  # input only
    for r in rows:
        assert {"mechanism", "n", "train_ratio", "infer_ratio", "peak_mem_mb", "path"} <= r.keys()
        assert r["train_ratio"] > 0 and r["infer_ratio"] > 0
        if r["mechanism"] == "sdpa":
            assert r["train_ratio"] == 1.0
    assert {r["path"] for r in rows if r["mechanism"] == "t5"} == {"dense"}  # short inputs
    grid = (tmp_path / "out" / "bench.md").read_text()  # the documentation's grid of the layer rows
    assert "| mechanism (path) | n=64 b=1 | n=128 b=1 |" in grid and "| t5 (dense) | **" in grid
    assert "| sdpa (sdpa) | **1.00** (1.00–1.00) / 1.00 | **1.00** (1.00–1.00) / 1.00 |" in grid


@pytest.mark.skipif(not memory_supported(), reason="peak memory needs Linux /proc/self/clear_refs")
def test_peak_memory_child_process() -> None:
    sizes = Sizes(heads=2, head_dim=16, max_len=256)
    specs = [CaseSpec("op", "sdpa", 256), CaseSpec("op", json.dumps(["t5"]), 256),
             CaseSpec("layer", json.dumps(["nonexistent"]), 256)]
    mem = measure_memory(specs, sizes, threads=1, timeout=300)
    assert mem[specs[0]]["train_mb"] >= 0 and mem[specs[1]]["train_mb"] >= 0
    assert "error" in mem[specs[2]]


@pytest.mark.skipif(importlib.util.find_spec("x_transformers") is None, reason="x-transformers absent")
def test_peers_share_the_run(tmp_path: Path) -> None:
    rows = run_cli(tmp_path, "-m", "t5", "--peers", "--no-memory", "-n", "64", "--kinds", "layer")
    names = {r["mechanism"] for r in rows}
    assert {"xt_t5", "xt_alibi", "t5", "alibi"} <= names  # peers and the mechanisms they match
    assert all(r["train_ms"] > 0 for r in rows if r["kind"] == "peer")


def test_conv_timings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--conv", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "conv.json").read_text())
    assert [r["kernel"] for r in rows][:3] == [1, 2, 3]
    assert all(r["shift_ms"] > 0 and r["fft_ms"] > 0 and r["chosen"] for r in rows)
    # the compiled shift-and-add only up to one tap past SHIFT_MAX: each length compiles its own graph
    timed = [r["kernel"] for r in rows if "compiled_ms" in r]
    assert timed == [r["kernel"] for r in rows if r["kernel"] <= SHIFT_MAX + 1] == [1, 2, 3, 4, 5]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("depthwise conv, training step ms (n=512") and len(printed) == 1 + len(rows)
    assert "compiled        -" in printed[-1] and "shift " in printed[-1] and printed[-1].endswith("-> chosen: fft")


def test_targets_and_specs() -> None:
    rows = [{"mechanism": "t5", "kind": "layer", "n": 4096, "train_ratio": 1.7, "peak_mem_mb": 100.0},
            {"mechanism": "t5", "kind": "layer", "n": 16384, "train_ratio": None, "peak_mem_mb": 420.0},
            {"mechanism": "rope", "kind": "layer", "n": 4096, "train_ratio": 1.1, "peak_mem_mb": None},
            {"mechanism": "xt_t5", "kind": "peer", "n": 2048, "train_ms": 300.0},
            {"mechanism": "t5", "kind": "layer", "n": 2048, "train_ms": 100.0}]
    lines = targets(rows, {"xt_t5": "t5"})
    assert any("t5: MISSED" in x and "1.6" in x for x in lines)
    assert any("rope: met" in x for x in lines)
    assert any("16384" in x and "met" in x for x in lines)
    assert any("xt_t5" in x and "3.0" in x and "met" in x for x in lines)
    assert parse_mechanisms("cat+tisa") == ["cat", "tisa"]
    assert spec_label(parse_mechanisms('[{"name": "tisa", "n_kernels": 3}]')) == "tisa(n_kernels=3)"
    assert make_case(CaseSpec("op", json.dumps(["absolute"]), 8), Sizes(2, 4, max_len=8)) is None


def test_bad_mechanism_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *TINY, "-m", "nope"]) == 2
    assert "unknown mechanism 'nope'" in capsys.readouterr().err


def test_batch_grid_rows_and_ranges(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_cli(tmp_path, "-m", "fixed_conv", "-n", "32", "--batch", "2", "3", "--kinds", "layer",
                   "--no-memory", "--repeats", "2")
    assert {(r["mechanism"], r["batch"]) for r in rows} == {(m, b) for m in ("sdpa", "fixed_conv") for b in (2, 3)}
    for r in rows:
        lo, hi = r["train_ratio_range"]
        assert 0 < lo <= hi and len(r["train_runs_ms"]) == 2
        assert lo <= r["train_ratio_rounds"] <= hi  # the median of the per-round ratios
    assert "batch" in capsys.readouterr().out


def test_grid_targets_lines() -> None:
    from posattn.bench.report import grid_targets

    rows = [{"mechanism": "t5", "kind": "layer", "n": 128, "batch": 16, "train_ratio": 1.05, "infer_ratio": 1.2},
            {"mechanism": "cat", "kind": "layer", "n": 512, "batch": 64, "train_ratio": 1.3, "causal": True},
            {"mechanism": "t5", "kind": "layer", "n": 4096, "batch": 1, "train_ratio": 3.0},
            {"mechanism": "posattn_encoder", "kind": "model", "n": 128, "batch": 32, "speed_vs_hf_bert": 0.9}]
    lines = grid_targets(rows)
    assert any("train ×1.05 ≤ 1.1" in x and "t5: met" in x for x in lines)
    assert any("infer ×1.20 ≤ 1.05" in x and "MISSED" in x for x in lines)
    assert any("causal" in x and "cat: MISSED" in x for x in lines)
    assert not any("4096" in x for x in lines)
    assert any("hf_bert = 0.90" in x and "MISSED" in x for x in lines)


def test_models_against_hugging_face(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    rows = run_cli(tmp_path, "--models", "-n", "16", "--batch", "2", "--no-memory", "-m", "t5")
    names = {r["mechanism"] for r in rows}
    assert {"posattn_encoder", "posattn_mlm", "posattn_decoder", "hf_bert", "hf_gpt_neox", "hf_llama"} <= names
    assert {"posattn_encoder(t5)", "posattn_decoder(t5)"} <= names
    enc = next(r for r in rows if r["mechanism"] == "posattn_encoder")
    assert enc["tokens_per_s"] > 0 and enc["speed_vs_hf_bert"] > 0 and enc["dropout"] == 0.1
    assert next(r for r in rows if r["mechanism"] == "posattn_mlm")["speed_vs_hf_bert"] > 0
    dec = next(r for r in rows if r["mechanism"] == "posattn_decoder(t5)")
    assert dec["speed_vs_hf_gpt_neox"] > 0 and "speed_vs_hf_bert" not in dec
    assert "speed ÷ BERT" in capsys.readouterr().out


def test_models_ab_times_posattns_models_again_under_the_overrides(tmp_path: Path) -> None:
    """``--models --ab``: every posattn model a second time under the Policy overrides, in the same
    rounds, each arm with its ratio to BERT; the Hugging Face models once. ``--policy`` holds for
    the whole run."""
    pytest.importorskip("transformers")
    rows = run_cli(tmp_path, "--models", "-n", "16", "--batch", "2", "--no-memory", "-m", "absolute",
                   "--ab", "split_qkv=True", "--policy", "native=False")
    assert all(r.get("policy") == {"native": False} for r in rows)   # the run's own policy, on every model
    names = [r["mechanism"] for r in rows]
    assert "posattn_encoder [split_qkv=True]" in names and "posattn_decoder [split_qkv=True]" in names
    assert not any(n.startswith("hf_") and "[" in n for n in names) and names.count("hf_bert") == 1
    arm = next(r for r in rows if r["mechanism"] == "posattn_encoder [split_qkv=True]")
    assert arm["speed_vs_hf_bert"] > 0 and arm["tokens_per_s"] > 0


def test_models_are_the_same_shape() -> None:
    """The posattn models and their Hugging Face peers have the same parameter count up to
    the architecture's stated differences (BERT: token types, embedding LayerNorm; Llama:
    a third MLP matrix and no biases)."""
    pytest.importorskip("transformers")
    from posattn.bench.models import _hf, _posattn

    sizes = Sizes(heads=2, head_dim=8, vocab=50, layers=2, d_ff=32, max_len=16)
    count = {name: sum(p.numel() for p in model.parameters())
             for name, model in [("enc", _posattn("posattn_encoder", ["absolute"], sizes, 16)[0]),
                                 ("dec", _posattn("posattn_decoder", ["rope"], sizes, 16)[0]),
                                 *[(hf, _hf(hf, sizes, 16)[0]) for hf in ("hf_bert", "hf_gpt_neox")]]}
    d = sizes.d_model
    assert count["hf_bert"] - count["enc"] == 2 * d  # token types (2 × d) + embedding LN (2d) − final LN (2d)
    assert count["hf_gpt_neox"] == count["dec"]


def test_each_posattn_loss_has_its_peers_precision() -> None:
    """In bf16 the encoder's loss is taken on bf16 logits as BertForMaskedLM's is, the decoder's
    on fp32 logits as the causal-LM loss of GPT-NeoX and Llama: a speed ratio then compares the
    models, not two loss precisions."""
    pytest.importorskip("transformers")
    from posattn.bench.models import _hf, _posattn

    sizes = Sizes(heads=2, head_dim=8, vocab=50, layers=1, d_ff=32, max_len=16, dtype="bfloat16")
    dtypes = {}
    for name, (model, loss) in [("enc", _posattn("posattn_encoder", ["absolute"], sizes, 16)),
                                ("dec", _posattn("posattn_decoder", ["rope"], sizes, 16)),
                                *[(hf, _hf(hf, sizes, 16)) for hf in ("hf_bert", "hf_llama")]]:
        model.to(torch.bfloat16)
        dtypes[name] = loss().dtype
    assert dtypes == {"enc": torch.bfloat16, "hf_bert": torch.bfloat16, "dec": torch.float32,
                      "hf_llama": torch.float32}


def test_pretraining_objective_case_has_the_full_cases_loss() -> None:
    """posattn_mlm (the last block and logits at the masked rows only) computes the loss of
    posattn_encoder (logits everywhere) for the same weights and batch."""
    from posattn.bench.models import _posattn

    sizes = Sizes(heads=2, head_dim=8, vocab=50, layers=2, d_ff=32, max_len=16, dropout=0.0)
    losses = []
    for kind in ("posattn_encoder", "posattn_mlm"):
        torch.manual_seed(0)
        losses.append(_posattn(kind, ["absolute"], sizes, 16)[1]())
    torch.testing.assert_close(losses[0], losses[1])


def test_relative_key_query_peer_skips_under_transformers_5(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from importlib.metadata import version

    from posattn.bench.peers import available, skipped

    if int(version("transformers").split(".")[0]) < 5:
        assert "hf_bert_relative_key_query" in available()
        return
    assert "hf_bert_relative_key_query" not in available()
    assert "needs transformers < 5" in skipped()["hf_bert_relative_key_query"]


def test_dropout_grid_and_unavailable_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_cli(tmp_path, "-m", "t5", "-n", "32", "--kinds", "layer", "--no-memory", "--dropout", "0.1")
    t5 = next(r for r in rows if r["mechanism"] == "t5")
    assert t5["dropout"] == 0.1 and t5["path"].startswith("dense")  # dropout: one dense bias
    if not torch.cuda.is_available():
        assert main(["bench", *TINY, "--device", "cuda"]) == 2
        assert "--device cuda is not available" in capsys.readouterr().err


def test_policy_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_cli(tmp_path, "-m", "fixed_conv", "-n", "64", "--kinds", "layer", "--no-memory",
                   "--policy", "dense_max_n=0", "force=flash_bias", "grad_chunk=16")
    assert next(r for r in rows if r["mechanism"] == "fixed_conv")["path"] == "flash_bias"
    assert all(r["policy"] == {"dense_max_n": 0, "force": "flash_bias", "grad_chunk": 16} for r in rows)
    first = (tmp_path / "out" / "bench.txt").read_text().splitlines()[0]  # what the ratios were measured under
    assert first.startswith("posattn bench: cpu, float32, ") and ", eager; " in first
    assert first.endswith("fast path under dense_max_n=0 force=flash_bias grad_chunk=16")
    assert main(["bench", *TINY, "--policy", "nope=1", "dense_max_n"]) == 2
    err = capsys.readouterr().err
    assert "nope=1" in err and "dense_max_n" in err and "band_fraction" in err


def test_ab_times_every_mechanism_again_under_other_policy_fields(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``--ab``: each mechanism a second time, labelled with the overrides, in the same run; its
    path shows the B policy (here: dense instead of flash-bias), the A arm keeps the run's."""
    rows = run_cli(tmp_path, "-m", "fixed_conv", "-n", "64", "--kinds", "layer", "op",
                   "--policy", "dense_max_n=0", "force=flash_bias", "grad_chunk=16", "--ab", "force=dense")
    paths = {(r["mechanism"], r["kind"]): r["path"] for r in rows}
    assert paths[("fixed_conv", "layer")] == "flash_bias" and paths[("fixed_conv [force=dense]", "layer")] == "dense"
    assert paths[("fixed_conv [force=dense]", "op")] == "dense"
    b = next(r for r in rows if r["mechanism"] == "fixed_conv [force=dense]")
    assert b["train_ratio"] > 0 and b["infer_ratio"] > 0
    spec = CaseSpec("layer", json.dumps(["t5"]), 32, json.dumps({"native": False}))
    assert spec.label == "t5 [native=False]"
    assert main(["bench", *TINY, "--ab", "nope=1"]) == 2
    assert "bench --ab: bad item(s) nope=1" in capsys.readouterr().err


def test_targets_come_from_the_cost_classes_and_keep_the_issues_lists() -> None:
    """The targets derive from each mechanism's cost class; they equal the issues' lists (4, 11, 27)."""
    cheap = ["none", "absolute", "sinusoidal", "rope", "alibi", "diet_abs", "tupe", "segment", "cat", "conv_qkv",
             "depthwise_conv", "sandwich", "forgetting", "xpos"]
    tables = ["t5", "fixed_conv", "dynamic_conv", "composite", "key_dynamic_conv", "diet_rel", "tisa", "kerple",
              "dynamic_pos_bias", "transformer_xl", "deberta"]
    assert TRAIN_TARGETS == {**dict.fromkeys(cheap, 1.25), **dict.fromkeys(tables, 1.6)}
    score_terms = ["t5", "fixed_conv", "dynamic_conv", "key_dynamic_conv", "composite", "tisa", "diet_rel", "alibi",
                   "segment", "kerple", "sandwich", "dynamic_pos_bias", "transformer_xl", "deberta"]
    heavy = ["conv_qkv", "depthwise_conv", "cat", "diet_abs", "tupe"]
    assert GRID_TARGETS == {**dict.fromkeys(score_terms, (1.10, 1.05)), **dict.fromkeys(heavy, (1.25, 1.15)),
                            **dict.fromkeys(["rope", "xpos", "forgetting"], (1.10, None))}  # issue 27: training only
    assert MODEL_TARGETS == {name: train for name, (train, infer) in GRID_TARGETS.items() if infer is not None}


def test_targets_judge_the_median_of_the_per_round_ratios_where_a_row_has_it() -> None:
    rows = [{"mechanism": "t5", "kind": "layer", "n": 512, "batch": 16, "train_ratio": 1.30,
             "train_ratio_rounds": 1.04, "infer_ratio": 1.02},
            {"mechanism": "t5", "kind": "layer", "n": 128, "batch": 16, "train_ratio": 1.30, "infer_ratio": 1.02}]
    lines = targets(rows, {})
    assert any("train ×1.04 ≤ 1.1 at n=512" in x and "t5: met" in x for x in lines)
    assert any("train ×1.30 ≤ 1.1 at n=128" in x and "t5: MISSED" in x for x in lines)  # no per-round median


def test_option_variants_are_judged_by_their_mechanisms_target() -> None:
    """``alibi(heads=2)`` and ``rope(fraction=0.5)`` rows meet their mechanism's targets; the
    forget gate and the rotations have a training target only; combinations and A/B arms none."""
    rows = [{"mechanism": "alibi(heads=2)", "kind": "layer", "n": 512, "batch": 16, "train_ratio": 1.2,
             "infer_ratio": 1.0},
            {"mechanism": "rope(fraction=0.5)", "kind": "layer", "n": 128, "batch": 16, "train_ratio": 1.05,
             "infer_ratio": 1.3},
            {"mechanism": "forgetting", "kind": "layer", "n": 512, "batch": 16, "train_ratio": 1.08, "infer_ratio": 1.3,
             "causal": True},
            {"mechanism": "forgetting", "kind": "layer", "n": 4096, "batch": 1, "train_ratio": 1.3},
            {"mechanism": "cat+tisa", "kind": "layer", "n": 512, "batch": 16, "train_ratio": 2.0},
            {"mechanism": "t5 [native=False]", "kind": "layer", "n": 512, "batch": 16, "train_ratio": 2.0}]
    lines = targets(rows, {})
    assert any("train ×1.20 ≤ 1.1" in x and "alibi(heads=2): MISSED" in x for x in lines)
    assert any("infer ×1.00 ≤ 1.05" in x and "alibi(heads=2): met" in x for x in lines)
    assert any("train ×1.05 ≤ 1.1" in x and "rope(fraction=0.5): met" in x for x in lines)
    assert any("causal" in x and "forgetting: met" in x for x in lines)
    assert any("n=4096" in x and "forgetting: MISSED" in x and "1.25" in x for x in lines)
    assert not any("infer" in x and ("rope" in x or "forgetting" in x) for x in lines)
    assert not any("cat+tisa" in x or "native=False" in x for x in lines)
