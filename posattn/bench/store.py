"""Benchmark rows as results-store records (:mod:`posattn.experiments.store`), one per measured setup.

A setup is what determines a number: the bench kind (``layer`` or ``model``), the case (a
mechanism's label, ``sdpa``, or a model such as ``posattn_encoder(alibi)`` / ``hf_bert``), the
length, the batch, the precision, the mode (``eager`` or a ``torch.compile`` mode), the
hardware and the model's size. A record's id is a hash of that content, so a later run on the
same kind of machine finds what exists and measures only what is missing (:func:`missing`),
and records from several machines merge by copying files.

Beside the records, ``recipe.json`` (kind ``recipe``, sweep ``bench``) says what the recipe is,
so that ``posattn report`` renders it (:mod:`.records`); the total is open (``cells_total``
None): which setups the grid still lacks is :func:`.gpu_check.layer_todo`'s to say.

A row's ratios (``train_ratio`` to plain SDPA, ``speed_vs_hf_bert``...) were measured in the
same interleaved rounds as their reference; the record keeps the row whole, so a ratio is never
formed from two runs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..experiments import store
from .cases import Sizes

LAYER_RECIPE = "gpu_layer_bench"
MODEL_RECIPE = "gpu_model_bench"
AB_RECIPE = "gpu_layer_ab"  # both arms of each A/B run of the GPU command, layer records (its own store: a
# setup the grid holds is measured again here, beside its alternative)
MODEL_AB_RECIPE = "gpu_model_ab"  # whole models under a fast-path alternative beside the default (``--ab``)
PROFILE_RECIPE = "gpu_profile"  # one profiled training step per setup (:mod:`.profile`), layer and model
# the size fields that change a number (device and max_len follow from hardware and n)
SIZE_FIELDS = ("heads", "head_dim", "causal", "vocab", "layers", "d_ff", "dropout")


def setup(bench: str, case: str, n: int, batch: int, sizes: Sizes, mode: str, hardware: str,
          policy: dict[str, Any] | None = None) -> dict[str, Any]:
    """The content that identifies one measurement; ``policy``: the fast-path Policy fields the
    run was under (``posattn bench --policy``), part of the content only when there are some."""
    return {"bench": bench, "case": case, "n": n, "batch": batch, "dtype": sizes.dtype, "mode": mode,
            "hardware": hardware, **{k: getattr(sizes, k) for k in SIZE_FIELDS},
            **({"policy": policy} if policy else {})}


def missing(recipe: str, keys: list[dict[str, Any]], root: str | Path | None = None) -> list[dict[str, Any]]:
    """The setups of ``keys`` that have no record in the store yet."""
    return [k for k in keys if not store.record_path(recipe, store.content_id(k), root).exists()]


SWEEP = "bench"  # the kind of sweep of the bench recipes' recipe.json (posattn.experiments.report)


def publish_recipe(recipe: str, bench: str, prov: dict[str, str], root: str | Path | None = None) -> bool:
    """Write the recipe's ``recipe.json`` (the bench kind, ``layer`` or ``model``) unless it is
    there; True if written."""
    result = {"sweep": SWEEP, "config": {"bench": bench}, "cells_total": None}
    return store.publish(recipe, store.RECIPE_ID, result, prov, kind="recipe", root=root)


def publish_rows(recipe: str, bench: str, rows: list[dict[str, Any]], sizes: Sizes, mode: str,
                 prov: dict[str, str], root: str | Path | None = None) -> tuple[int, int]:
    """Store every measured row (rows with an error are left out, so a later run retries them);
    returns (written, already there). The recipe's ``recipe.json`` is written with the first rows."""
    written = kept = 0
    measured = [row for row in rows if not row.get("error") and row.get("train_ms") is not None]
    if measured:
        publish_recipe(recipe, bench, prov, root)
    for row in measured:
        key = setup(bench, row["mechanism"], row["n"], row["batch"], sizes, mode, prov["hardware"], row.get("policy"))
        if store.publish(recipe, store.content_id(key), {**key, "row": row}, prov, root=root):
            written += 1
        else:
            kept += 1
    return written, kept
