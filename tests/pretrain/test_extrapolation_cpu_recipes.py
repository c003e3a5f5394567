"""The CPU-scale length-extrapolation recipes are their full recipes reduced only in size and budget:
the same mechanisms, data, training length, optimiser settings, test lengths and claims."""
from __future__ import annotations

import pytest

from posattn.experiments.config import find_config
from posattn.pretrain.config import load as load_recipe
from posattn.synthetic.compare import load_config, validate_config

REDUCED = {"preset", "steps", "eval_every", "checkpoint_every", "name"}   # what the CPU scale may change
# The language-model recipe also changes how the same texts are tokenised (a WordPiece of 1024 entries,
# built by a command of its header) and the peak learning rate: at 8192 entries and lr 1e-3 the mini
# models stayed worse than a bigram model and used no context, so they measured no extrapolation.
LM_RETUNED = {"batch_size", "corpus", "lr"}


def test_pretraining_cpu_recipe_differs_only_in_size_budget_and_tokenizer():
    _, full = load_recipe("length_extrapolation")
    name, cpu = load_recipe("length_extrapolation_cpu")
    assert name == "length_extrapolation_cpu" and [label for label, _ in cpu] == [label for label, _ in full]
    for (label, a), (_, b) in zip(full, cpu):
        a, b = a.to_dict(), b.to_dict()
        changed = {k for k in a if a[k] != b[k]}
        assert changed <= REDUCED | LM_RETUNED, (label, changed)
        assert b["steps"] * b["batch_size"] < a["steps"] * a["batch_size"]
    header = find_config("length_extrapolation_cpu", "posattn.pretrain", "recipe")[0].splitlines()
    corpus = cpu[0][1].corpus
    assert f"#   posattn corpus --vocab-size 1024 --out {corpus}" in header   # the default texts, retokenised


def test_pretraining_cpu_recipe_header_runs_every_rescaling_to_16x():
    header = [line for line in find_config("length_extrapolation_cpu", "posattn.pretrain", "recipe")[0].splitlines()
              if line.startswith("#")]
    full = [line for line in find_config("length_extrapolation", "posattn.pretrain", "recipe")[0].splitlines()
            if line.startswith("#   for kind in")]
    assert [line for line in header if line.startswith("#   for kind in")] == full
    evals = [line for line in header if "--multipliers" in line]
    assert len(evals) == 2 and all("--multipliers 1 2 4 8 16 --tokens 16384" in line for line in evals)
    assert any(line.startswith("#   posattn report length_extrapolation_cpu") for line in header)


@pytest.mark.parametrize("task", ["ar", "copy"])
def test_synthetic_cpu_recipe_keeps_models_claims_and_lengths_with_two_seeds(task):
    full, cpu = load_config(f"length_extrapolation_{task}"), load_config(f"length_extrapolation_{task}_cpu")
    for key in ("task", "task_params", "vocab_size", "train_length", "test_multipliers", "examples", "models",
                "claims", "d_model", "n_heads", "d_ff"):
        assert cpu[key] == full[key], key
    assert len(cpu["seeds"]) >= 2 and set(cpu["training"]["lr"]) <= set(full["training"]["lr"])
    assert cpu["training"]["steps"] <= full["training"]["steps"]
    assert len(validate_config(cpu).cells) == 9 * len(cpu["seeds"])


def test_mqar_cpu_recipe_keeps_the_models_and_claims_of_the_ar_recipe():
    """The CPU-sized multi-query recipe compares the same mechanisms on the same claims; what
    differs is the task (every key queried, so it learns within a CPU budget) and its size."""
    full, mqar = load_config("length_extrapolation_ar"), load_config("length_extrapolation_mqar_cpu")
    for key in ("models", "claims", "test_multipliers", "d_ff", "n_heads", "init_std"):
        assert mqar[key] == full[key], key
    assert mqar["task"] == "mqar" and mqar["train_length"] < full["train_length"]
    assert mqar["training"]["steps"] < full["training"]["steps"]
    assert len(validate_config(mqar).cells) == 9 * len(mqar["seeds"]) and len(mqar["seeds"]) >= 3
