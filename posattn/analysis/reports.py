"""The five analyses as functions: each takes a model (folder path, ``minilm`` / ``mpnet``, or an
already opened source), writes PNG figures and ``<name>.json`` into ``out`` and returns the JSON dict."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..models import ModelConfig, Transformer, build_model, save
from . import plots
from .hf import CheckpointError, HFCheckpoint
from .native import (
    Source,
    describe,
    learned_structures,
    open_source,
    posattn_profiles,
    position_scores,
    position_table,
    score_matrices64,
)
from .profiles import Profiles, hf_profiles
from .rank import numerical_rank
from .tisa_fit import TisaFit, fit_tisa
from .toeplitz import adjacent_cosine, cosine_by_offset, gram, toeplitz_r2

ModelArg = str | Path | Source


def _source(model: ModelArg) -> Source:
    return model if isinstance(model, (HFCheckpoint, Transformer)) else open_source(model)


def _r(x: Any, digits: int = 5) -> Any:
    """Numpy values -> JSON-ready floats/lists, rounded."""
    arr = np.asarray(x)
    if arr.dtype.kind in "iub":
        return arr.tolist()
    return np.round(arr.astype(np.float64), digits).tolist()


def _write(out: Path, name: str, report: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    return report


# -- 1. Toeplitzness of P = E_P E_Pᵀ -------------------------------------------------------------
def toeplitz(model: ModelArg, out: Path, positions: int | None = None) -> dict:
    """TISA §3.1 / App. B: Toeplitz R² of P = E_P E_Pᵀ, heatmap and cosine profiles."""
    src = _source(model)
    e = (src.position_embeddings(positions) if isinstance(src, HFCheckpoint)
         else position_table(src, positions)).numpy()
    p = gram(e)
    r2 = float(toeplitz_r2(p))
    unit = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-300)
    adjacent = adjacent_cosine(e)
    report = {"analysis": "toeplitz", **describe(src), "n_positions": int(e.shape[0]), "dim": int(e.shape[1]),
              "r2": round(r2, 6), "r2_cosine": round(float(toeplitz_r2(unit @ unit.T)), 6),
              "r2_first_128": round(float(toeplitz_r2(p[:128, :128])), 6) if e.shape[0] > 128 else None,
              "adjacent_cosine_mean": round(float(adjacent.mean()), 6),
              "adjacent_cosine_min": round(float(adjacent.min()), 6),
              "figures": ["toeplitz.png"]}
    out.mkdir(parents=True, exist_ok=True)
    plots.toeplitz_figure(p, cosine_by_offset(e), adjacent, r2, report["kind"], out / "toeplitz.png")
    return _write(out, "toeplitz", report)


# -- 2. Positional score profiles F̂_P -------------------------------------------------------------
def compute_profiles(src: Source, positions: int = 128, method: str = "embedding", layer_norm: bool = True,
                     relative_bias: bool = True) -> Profiles:
    """F̂_P of a HF checkpoint (:func:`hf_profiles`) or a posattn model (:func:`posattn_profiles`)."""
    if isinstance(src, HFCheckpoint):
        return hf_profiles(src, positions, None, layer_norm, relative_bias, method)
    return posattn_profiles(src, positions)


def _rows(n: int) -> list[int]:
    return sorted({int(x) for x in np.linspace(n // 8, n - 1 - n // 8, 5)})


def profiles(model: ModelArg, out: Path, positions: int = 128, method: str = "embedding",
             layer_norm: bool = True, relative_bias: bool = True, half_width: int = 20) -> dict:
    """TISA §3.2, Eq 9-12: F̂_P per layer and head, its Toeplitz R², sections through the diagonal."""
    src = _source(model)
    prof = compute_profiles(src, positions, method, layer_norm, relative_bias)
    r2 = prof.r2()
    out.mkdir(parents=True, exist_ok=True)
    figures = []
    for layer in range(r2.shape[0]):
        name = f"sections_layer{layer}.png"
        plots.sections_figure(prof.scores[layer], r2[layer], layer, _rows(prof.n), half_width, out / name)
        figures.append(name)
    plots.heatmaps_figure(prof.scores[0], [f"H{h} R²={r2[0, h]:.2f}" for h in range(r2.shape[1])],
                          "layer 0: F̂_P per head", out / "fhat_layer0.png")
    figures.append("fhat_layer0.png")
    report = {"analysis": "profiles", **describe(src), "n_positions": prof.n, "method": prof.method,
              "layer_norm": prof.layer_norm, "relative_bias_included": prof.relative_bias,
              "r2_per_layer_head": _r(r2, 4), "r2_mean_per_layer": _r(r2.mean(1), 4),
              "r2_mean": round(float(r2.mean()), 4), "r2_median": round(float(np.median(r2)), 4),
              "r2_min": round(float(r2.min()), 4), "r2_max": round(float(r2.max()), 4), "figures": figures}
    return _write(out, "profiles", report)


# -- 3. TISA kernels fitted to F̂_P, and a tisa model built from the fit -----------------------------
def build_tisa_model(src: Transformer, fit: TisaFit, mode: str = "replace") -> Transformer:
    """A posattn model with ``tisa`` kernels set from the fit (TISA App. C initialisation): the
    same configuration with its input position mechanism dropped (``replace``) or kept
    (``supplement``) and its other score-level position mechanisms removed; every weight whose
    name and shape match is copied. The fitted offsets are dropped (softmax is invariant to them).
    (A Hugging Face checkpoint keeps all of its own weights instead: :func:`posattn.hf.retrofit.retrofit_tisa`.)
    """
    tisa = {"name": "tisa", "n_kernels": int(fit.a.shape[-1]), "mode": mode}
    keep = [m for m in src.input_mechanisms if m.name in ("absolute", "sinusoidal")] if mode == "supplement" else []
    specs = [spec for spec in src.cfg.mechanisms
             if (spec if isinstance(spec, str) else spec["name"]) in {m.name for m in keep}]
    cfg = ModelConfig.from_dict({**src.cfg.to_dict(), "mechanisms": [*specs, tisa]})
    model = build_model({"kind": src.kind, **cfg.to_dict()})
    theirs = src.state_dict()
    mine = model.state_dict()
    model.load_state_dict({k: v for k, v in theirs.items() if k in mine and mine[k].shape == v.shape},
                          strict=False)
    if fit.a.shape[0] != model.cfg.n_layers:
        raise CheckpointError(f"the fit covers {fit.a.shape[0]} layers; the model has {model.cfg.n_layers}")
    with torch.no_grad():
        for layer, block in enumerate(model.blocks):
            mech = next(m for m in block.attn.mechanisms if m.name == "tisa")
            for name in ("a", "b", "c"):
                getattr(mech, name).copy_(torch.as_tensor(getattr(fit, name)[layer]))
    return model


def fit_tisa_report(model: ModelArg, out: Path, positions: int = 128, n_kernels: int = 5,
                    window: int | None = None, method: str = "embedding", restarts: int = 6,
                    adam_steps: int = 400, lbfgs_steps: int = 150, build: bool = True,
                    mode: str = "replace") -> dict:
    """TISA App. C: S kernels per head fitted to F̂_P by weighted least squares; errors; plots;
    and (``build``) a model with TISA kernels initialised from the fit in ``out/tisa_model``: the
    pretrained Hugging Face model with TISA added in every self-attention (``posattn.hf``), or
    the posattn model rebuilt with ``tisa``."""
    src = _source(model)
    prof = compute_profiles(src, positions, method)
    fit = fit_tisa(prof.scores, n_kernels, window, restarts, adam_steps, lbfgs_steps)
    n, w = prof.n, fit.window
    r = np.arange(-w, w + 1)
    target = prof.offset_profiles()[..., n - 1 - w: n + w]
    fitted = fit.function(r) + fit.offset[..., None]
    out.mkdir(parents=True, exist_ok=True)
    figures = []
    for layer in range(target.shape[0]):
        name = f"fit_layer{layer}.png"
        plots.fit_figure(r, target[layer], fitted[layer], fit.r2[layer], layer, out / name)
        figures.append(name)
    report = {"analysis": "fit-tisa", **describe(src), "n_positions": n, "window": w, "n_kernels": n_kernels,
              "method": prof.method, "loss": "Σ_r w_r (f_θ(r) + o − t_r)², t_r diagonal means, w_r = (n−|r|)/n²",
              "optimizer": f"Adam {adam_steps} steps + L-BFGS {lbfgs_steps} iterations, best of {restarts} restarts",
              "fit_r2_median": round(float(np.median(fit.r2)), 4), "fit_r2_mean": round(float(fit.r2.mean()), 4),
              "fit_r2_min": round(float(fit.r2.min()), 4),
              "matrix_r2_median": round(float(np.median(fit.matrix_r2)), 4),
              "toeplitz_r2_median": round(float(np.median(prof.r2())), 4),
              "rmse_median": round(float(np.median(fit.rmse)), 5), "rmse_max": round(float(fit.rmse.max()), 5),
              "per_head": {"rmse": _r(fit.rmse), "r2": _r(fit.r2, 4), "matrix_r2": _r(fit.matrix_r2, 4),
                           "a": _r(fit.a), "b": _r(fit.b, 7), "c": _r(fit.c), "offset": _r(fit.offset)},
              "figures": figures}
    if build:
        if isinstance(src, HFCheckpoint):  # the pretrained model itself, every weight kept
            try:
                from ..hf.retrofit import retrofit_tisa
            except ImportError as e:
                raise CheckpointError("building a TISA model from a Hugging Face checkpoint needs the hf "
                                      "extra (pip install 'posattn[hf]'); or pass --no-model") from e
            retrofit_tisa(src.folder, fit, mode, out / "tisa_model")
            report["tisa_model_kind"] = f"hf:{src.config['model_type']} + posattn tisa ({mode}); "\
                                        "load with posattn.hf.retrofit.load_retrofitted"
        else:
            save(build_tisa_model(src, fit, mode), out / "tisa_model")
        report["tisa_model"] = str(out / "tisa_model")
    return _write(out, "fit_tisa", report)


# -- 4. Attention rank --------------------------------------------------------------------------------
def _hf_position_term(src: HFCheckpoint, n: int) -> list[torch.Tensor]:
    """DIET Fig 8 for a HF checkpoint: (E_P W_Q)(E_P W_K)ᵀ/√d_h per layer and head, + relative bias."""
    e = src.position_embeddings(n)
    bias = src.relative_bias(n)
    h, dh = src.n_heads, src.head_dim
    out = []
    for layer in range(src.n_layers):
        wq, _, wk, _ = src.query_key(layer)
        q, k = (e @ wq).view(n, h, dh).transpose(0, 1), (e @ wk).view(n, h, dh).transpose(0, 1)
        s = q @ k.transpose(-1, -2) / math.sqrt(dh)
        out.append(s if bias is None else s + bias)
    return out


def _token_batch(src: Source, n: int, batch: int, seed: int, text: Path | None) -> torch.Tensor:
    if text is None:
        vocab = int(src.config["vocab_size"]) if isinstance(src, HFCheckpoint) else src.cfg.vocab_size
        return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))
    if not isinstance(src, HFCheckpoint) or not (src.folder / "tokenizer.json").is_file():
        raise CheckpointError("--text needs a Hugging Face checkpoint with tokenizer.json")
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(src.folder / "tokenizer.json")).encode(Path(text).read_text(),
                                                                          add_special_tokens=False).ids
    if len(ids) < n * batch:
        raise CheckpointError(f"{text}: {len(ids)} tokens, need {n * batch} for {batch} sequences of {n}")
    return torch.tensor(ids[: n * batch]).view(batch, n)


def rank_of(model: ModelArg, positions: int = 128, batch: int = 4, seed: int = 0, rtol: float | None = None,
            text: Path | None = None) -> dict:
    """DIET Thm 1 / Fig 2, 8: numerical ranks of the score matrices on a batch and of the position term."""
    src = _source(model)
    ids = _token_batch(src, positions, batch, seed, text)
    if isinstance(src, HFCheckpoint):
        from .hf_forward import hf_scores

        scores = hf_scores(src, input_ids=ids)
        pos = _hf_position_term(src, positions)
    else:
        if positions > src.cfg.max_len:
            raise CheckpointError(f"asked for {positions} positions; "
                                  f"the model was built with max_len {src.cfg.max_len}")
        scores = score_matrices64(src, ids)
        pos = position_scores(src, positions)
    ranks = np.stack([numerical_rank(s.numpy(), rtol) for s in scores])  # [L, b, H]
    pos_ranks = np.stack([numerical_rank(p.numpy(), rtol) for p in pos])  # [L, H]
    info = describe(src)
    dh = info["head_dim"]
    return {**info, "n_positions": positions, "batch": batch,
            "inputs": str(text) if text else f"uniform random token ids, seed {seed}",
            "rtol": rtol if rtol is not None else "max(n)·eps(float64)",
            "score_rank_per_layer_head": _r(ranks.min(1)), "score_rank_max_per_layer": _r(ranks.max((1, 2))),
            "score_rank_mean": round(float(ranks.mean()), 3), "score_rank_max": int(ranks.max()),
            "fraction_above_head_dim": round(float((ranks > dh).mean()), 4),
            "position_rank_per_layer_head": _r(pos_ranks), "position_rank_max": int(pos_ranks.max()),
            "position_rank_mean": round(float(pos_ranks.mean()), 3)}


def rank(models: list[ModelArg], out: Path, positions: int = 128, batch: int = 4, seed: int = 0,
         rtol: float | None = None, text: Path | None = None, names: list[str] | None = None) -> dict:
    """Rank report for one or more models, with one comparison figure (DIET Fig 2 and 8)."""
    names = names or [Path(str(m)).name if not isinstance(m, (HFCheckpoint, Transformer)) else f"model{i}"
                      for i, m in enumerate(models)]
    results = {name: rank_of(m, positions, batch, seed, rtol, text) for name, m in zip(names, models)}
    out.mkdir(parents=True, exist_ok=True)
    dhs = {r["head_dim"] for r in results.values()}
    bound = dhs.pop() if len(dhs) == 1 else None
    plots.rank_figure({f"{k}: scores (min over batch)": np.asarray(v["score_rank_per_layer_head"])
                       for k, v in results.items()}
                      | {f"{k}: position term": np.asarray(v["position_rank_per_layer_head"])
                         for k, v in results.items()},
                      bound, f"numerical rank of attention scores, n = {positions}", out / "rank.png")
    return _write(out, "rank", {"analysis": "rank", "models": results, "figures": ["rank.png"]})


def random_pair(d_model: int = 64, n_heads: int = 4, n_layers: int = 2, max_len: int = 64,
                seed: int = 0) -> dict[str, Transformer]:
    """Two untrained encoders of equal size, input ``absolute`` vs ``diet_abs`` (rank d_p = d_h), for
    the DIET Thm 1 comparison: the bound rank ≤ d_h holds for any weights, and generic (random)
    weights already reach rank d_h + d_p with DIET-ABS."""
    base = {"kind": "encoder", "vocab_size": 1000, "d_model": d_model, "n_heads": n_heads,
            "n_layers": n_layers, "max_len": max_len}
    out = {}
    for mech in ("absolute", "diet_abs"):
        torch.manual_seed(seed)
        out[mech] = build_model({**base, "mechanisms": [mech]}).eval()
    return out


# -- 5. Learned structures ------------------------------------------------------------------------------
def kernels(model: ModelArg, out: Path, positions: int = 64, half_width: int | None = None) -> dict:
    """Chang Fig 2-3, TISA Fig 3, DIET Fig 4/7: what each position mechanism learned, per layer."""
    src = _source(model)
    figures, entries = [], []
    n = positions
    if isinstance(src, HFCheckpoint):
        bias = src.relative_bias(n)
        if bias is None:
            raise CheckpointError(f"{src.folder}: a {src.model_type} checkpoint has no learned position kernels "
                                  f"(only input embeddings: use 'analyze toeplitz' and 'analyze profiles')")
        table = torch.cat([bias[:, n - 1, :], bias[:, 0, 1:]], dim=1)  # offsets −(n−1) … n−1
        items = [{"layer": 0, "mechanism": "relative_attention_bias (all layers)", "kind": "offsets",
                  "data": table.numpy()}]
    else:
        items = learned_structures(src, n)
    if not items:
        raise CheckpointError("this posattn model has no learned position structure to plot "
                              f"(mechanisms: {describe(src).get('mechanisms')})")
    out.mkdir(parents=True, exist_ok=True)
    half = half_width or n - 1
    for i, item in enumerate(items):
        name = f"{i:02d}_layer{item['layer']}_{item['mechanism'].split(' ')[0].replace(':', '_')}.png"
        title = f"layer {item['layer']}: {item['mechanism']}"
        data = item["data"]
        entry: dict[str, Any] = {"layer": item["layer"], "mechanism": item["mechanism"], "kind": item["kind"],
                                 "figure": name}
        if item["kind"] == "offsets":
            r = np.arange(-(n - 1), n)
            keep = np.abs(r) <= half
            plots.offsets_figure(r[keep], data[:, keep], title, out / name)
            entry["argmax_offset_per_head"] = _r(r[keep][data[:, keep].argmax(1)])
        elif item["kind"] == "depthwise":
            plots.depthwise_figure(data, title, out / name)
        elif item["kind"] == "matrix":
            plots.heatmaps_figure(data, [f"H{h}" for h in range(len(data))], f"{title}: P_Q P_Kᵀ", out / name)
            entry["toeplitz_r2_per_head"] = _r(np.atleast_1d(toeplitz_r2(data)), 4)
        elif item["kind"] == "segment":
            plots.heatmaps_figure(data, [f"H{h}" for h in range(len(data))], f"{title}: E_S", out / name)
            entry["table"] = _r(data)
        else:
            plots.filter_figure(data, title, out / name)
        figures.append(name)
        entries.append(entry)
    return _write(out, "kernels", {"analysis": "kernels", **describe(src), "n_positions": n,
                                   "items": entries, "figures": figures})
