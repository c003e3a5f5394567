"""Rows, table, plot, JSON, and the speed targets for ``posattn bench``."""
from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..mechanisms import cost_classes
from ..runtime.files import write_json_atomic

# The targets as data, per cost class of the mechanism (``Mechanism.cost_class``; a mechanism
# whose class has no entry has no target). Long inputs: training-step ratio to plain SDPA at
# n = 4096 (batch 1, 4 heads, head dim 64); the forget gate's class at 1.25 too.
TRAIN_TARGET_BY_CLASS: dict[str, float] = {
    **dict.fromkeys(["none", "input", "rotation", "fixed_bias", "narrow_low_rank", "wide_low_rank",
                     "convolution", "data_dependent_bias"], 1.25),
    **dict.fromkeys(["learned_table", "relative_embedding"], 1.6),
}
# Pretraining shapes: layer (training step, inference) ratios to plain SDPA; score
# terms that fold or tabulate cheaply against the heavier q/k/v-widening or convolving classes.
SCORE_TERM_GRID_BY_CLASS: dict[str, tuple[float, float]] = {
    **dict.fromkeys(["fixed_bias", "narrow_low_rank", "learned_table", "relative_embedding"], (1.10, 1.05)),
    **dict.fromkeys(["wide_low_rank", "convolution"], (1.25, 1.15)),
}
# The rotations and the forget gate's data-dependent bias, training step only (no
# inference target: None), at the same shapes.
GRID_TARGET_BY_CLASS: dict[str, tuple[float, float | None]] = {
    **SCORE_TERM_GRID_BY_CLASS, **dict.fromkeys(["rotation", "data_dependent_bias"], (1.10, None)),
}


def by_mechanism(by_class: dict[str, Any]) -> dict[str, Any]:
    """Mechanism name -> its class's target, for every registered mechanism that has one."""
    return {name: by_class[c] for name, c in cost_classes().items() if c in by_class}


def goal_of(targets: dict[str, Any], label: str) -> Any:
    """The target of a row's mechanism ``label`` (``alibi``, or with options ``alibi(heads=2)``:
    options do not change a mechanism's cost class); None for combinations (``cat+tisa``), runs
    under other fast-path settings (``t5 [native=False]``) and mechanisms without one."""
    name = label.split("(", 1)[0]
    return None if "+" in name or " [" in label else targets.get(name)


TRAIN_TARGETS: dict[str, float] = by_mechanism(TRAIN_TARGET_BY_CLASS)
TARGET_N = 4096
# GPU target, layer at n = 4096 (GPU, bf16; :mod:`.records` judges it, :mod:`.gpu_check` measures it
# first): the score terms that add a fixed or tabulated bias (ALiBi, T5, TISA, the relative
# convolutions) cost at most 1.25× the training step of FlashAttention-backed SDPA.
LAYER_TARGET_BY_CLASS: dict[str, float] = dict.fromkeys(["fixed_bias", "learned_table", "relative_embedding"], 1.25)
LAYER_TARGETS: dict[str, float] = by_mechanism(LAYER_TARGET_BY_CLASS)
LAYER_TARGET_N = 4096
MEMORY_PAIR = (4096, 16384)
MEMORY_RATIO = 5.0
PEER_N = 2048
PEER_SPEEDUP = {"hf_bert_relative_key_query": 5.0, "xt_t5": 2.0}
GRID_TARGETS: dict[str, tuple[float, float | None]] = by_mechanism(GRID_TARGET_BY_CLASS)
GRID_N = (128, 512)
GRID_BATCH = (16, 64)
MODEL_SPEED = 1.0  # posattn model tokens/s ÷ its Hugging Face peer's

COLUMNS = [("mechanism", "mechanism", "{}"), ("kind", "kind", "{}"), ("n", "n", "{}"),
           ("batch", "batch", "{}"), ("path", "path", "{}"), ("train_ms", "train ms", "{:.1f}"),
           ("train_ratio", "train ×", "{:.2f}"), ("train_ratio_range", "range", "{0[0]:.2f}–{0[1]:.2f}"),
           ("train_ratio_min", "min ×", "{:.2f}"), ("train_ratio_rounds", "round ×", "{:.2f}"),
           ("infer_ms", "infer ms", "{:.1f}"), ("infer_ratio", "infer ×", "{:.2f}"),
           ("infer_ratio_rounds", "round ×", "{:.2f}"),
           ("peak_mem_mb", "peak MB", "{:.0f}"), ("mem_ratio", "mem ×", "{:.2f}")]


def _fmt(fmt: str, x: Any) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)


MODEL_COLUMNS = [("mechanism", "model", "{}"), ("n", "n", "{}"), ("batch", "batch", "{}"),
                 ("dropout", "dropout", "{}"), ("train_ms", "step ms", "{:.0f}"),
                 ("tokens_per_s", "tokens/s", "{:.0f}"), ("infer_ms", "infer ms", "{:.0f}"),
                 ("peak_mem_mb", "peak MB", "{:.0f}"), ("speed_vs_hf_bert", "speed ÷ BERT", "{:.2f}"),
                 ("speed_vs_hf_gpt_neox", "÷ GPT-NeoX", "{:.2f}"), ("speed_vs_hf_llama", "÷ Llama", "{:.2f}"),
                 ("mem_vs_hf_bert", "mem ÷ BERT", "{:.2f}"), ("mem_vs_hf_gpt_neox", "÷ GPT-NeoX", "{:.2f}"),
                 ("mem_vs_hf_llama", "÷ Llama", "{:.2f}")]


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]] = COLUMNS) -> str:
    """Plain-text table, one line per row."""
    head = [c[1] for c in columns]
    body = [[_fmt(c[2], r.get(c[0])) for c in columns] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(head, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in body]
    return "\n".join(lines)


def model_table(rows: list[dict[str, Any]]) -> str:
    """The whole-model comparison (``--models``)."""
    return table(rows, MODEL_COLUMNS)


def judged(r: dict[str, Any], what: str) -> float | None:
    """The ratio a target judges: the median of the per-round ratios where the row has it (each
    round times the case next to its baseline, so a loaded machine's slow spells fall on both),
    else the ratio of the medians (rows recorded before that field)."""
    rounds = r.get(f"{what}_ratio_rounds")
    return rounds if rounds is not None else r.get(f"{what}_ratio")


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def grid_targets(rows: list[dict[str, Any]]) -> list[str]:
    """Layer ratios at n ∈ {128, 512}, batch ∈ {16, 64}, encoder and decoder."""
    out = []
    for r in rows:
        goal = goal_of(GRID_TARGETS, r["mechanism"])
        if not goal or r["kind"] != "layer" or r["n"] not in GRID_N or r.get("batch") not in GRID_BATCH:
            continue
        where = f"n={r['n']} batch={r['batch']}{' causal' if r.get('causal') else ''}"
        for what, limit in zip(("train", "infer"), goal):
            ratio = judged(r, what)
            if limit is not None and ratio is not None:
                out.append(f"{what} ×{ratio:.2f} ≤ {limit} at {where} (layer): {r['mechanism']}: "
                           f"{_verdict(ratio <= limit)}")
    for r in rows:
        for key in [k for k in r if k.startswith("speed_vs_")]:
            out.append(f"{r['mechanism']} tokens/s ÷ {key[9:]} = {r[key]:.2f} ≥ {MODEL_SPEED} at n={r['n']} "
                       f"batch={r['batch']}: {_verdict(r[key] >= MODEL_SPEED)}")
    return out


def targets(rows: list[dict[str, Any]], matches: dict[str, str]) -> list[str]:
    """The speed targets that these rows can check, one line each (met / MISSED)."""
    out: list[str] = grid_targets(rows)
    for r in rows:
        goal = goal_of(TRAIN_TARGETS, r["mechanism"])
        if (r["n"] == TARGET_N and r["kind"] == "layer" and r.get("batch", 1) == 1 and goal
                and judged(r, "train") is not None):
            ok = judged(r, "train") <= goal
            out.append(f"train ×{judged(r, 'train'):.2f} ≤ {goal} at n={TARGET_N} (layer): {r['mechanism']}: "
                       f"{'met' if ok else 'MISSED'}")
    mem = {(r["mechanism"], r["kind"], r["n"]): r.get("peak_mem_mb") for r in rows}
    lo, hi = MEMORY_PAIR
    for (mech, kind, n), peak in sorted(mem.items()):
        other = mem.get((mech, kind, hi))
        if n == lo and peak and other is not None:
            ratio = other / peak
            out.append(f"peak memory n={hi} / n={lo} = {ratio:.1f} ≤ {MEMORY_RATIO} ({kind}): {mech}: "
                       f"{'met' if ratio <= MEMORY_RATIO else 'MISSED'}")
    train = {(r["mechanism"], r["n"]): r.get("train_ms") for r in rows if r["kind"] in ("layer", "peer")}
    for peer, goal in PEER_SPEEDUP.items():
        ours = matches.get(peer)
        a, b = train.get((peer, PEER_N)), train.get((ours, PEER_N)) if ours else None
        if a and b:
            out.append(f"{peer} / posattn {ours} at n={PEER_N} = {a / b:.1f}× faster (≥ {goal}): "
                       f"{'met' if a / b >= goal else 'MISSED'}")
    return out


def _grid_cell(r: dict[str, Any] | None, stat: str) -> str:
    """``**training ratio** (per-round range) / inference ratio``, ``stat`` naming the ratio
    (``min``: min ÷ min; ``rounds``: the median of the per-round ratios)."""
    if r is None or r.get(f"train_ratio_{stat}") is None:
        return "–"
    lo, hi = r.get("train_ratio_range") or (math.nan, math.nan)
    return (f"**{r[f'train_ratio_{stat}']:.2f}** ({_fmt('{:.2f}', lo)}–{_fmt('{:.2f}', hi)}) / "
            f"{_fmt('{:.2f}', r.get(f'infer_ratio_{stat}'))}")


def grid_markdown(rows: list[dict[str, Any]], stat: str = "rounds") -> str:
    """The layer rows as the documentation's grids (``bench.md``): encoder and decoder apart, one
    line per mechanism with the fast paths it took, one column per length and batch; each cell the
    training step's ratio to plain SDPA in bold, its per-round range, then inference's ratio. The
    ratio is the median of the per-round ratios (``stat="rounds"``: each round times a case and its
    baseline close together, so a loaded machine's slow spells fall on both) or min ÷ min (``min``)."""
    layer = [r for r in rows if r["kind"] == "layer" and r.get(f"train_ratio_{stat}") is not None]
    out: list[str] = []
    for causal in sorted({bool(r.get("causal")) for r in layer}):
        group = [r for r in layer if bool(r.get("causal")) == causal]
        shapes = sorted({(r["n"], r.get("batch", 1)) for r in group})
        cells = {(r["mechanism"], r["n"], r.get("batch", 1)): r for r in group}
        out += [f"{'Decoder (causal)' if causal else 'Encoder'}:", "",
                "| mechanism (path) | " + " | ".join(f"n={n} b={b}" for n, b in shapes) + " |",
                "|---|" + "---|" * len(shapes)]
        for name in dict.fromkeys(r["mechanism"] for r in group):
            paths = ", ".join(dict.fromkeys(r["path"] for r in group if r["mechanism"] == name and r.get("path")))
            line = [f"{name} ({paths or '-'})", *(_grid_cell(cells.get((name, n, b)), stat) for n, b in shapes)]
            out.append("| " + " | ".join(line) + " |")
        out.append("")
    return "\n".join(out)


def save_json(rows: list[dict[str, Any]], path: Path) -> None:
    """The rows as a JSON list, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, rows, indent=2)


PANELS = (("train_ratio", "training step ÷ plain SDPA"), ("infer_ratio", "inference ÷ plain SDPA"),
          ("tokens_per_s", "training tokens/s (whole models)"),
          ("peak_mem_mb", "peak extra memory of a training step (MB)"))
RATIOS = ("train_ratio", "infer_ratio")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Per panel (train ratio, inference ratio, peak memory): lines against n, one per
    mechanism and kind; horizontal bars when only one length was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f, t) for f, t in PANELS if any(r.get(f) is not None for r in rows)]
    lengths = sorted({r["n"] for r in rows})
    mechs = sorted({r["mechanism"] for r in rows})
    kinds = [k for k in ("layer", "op", "peer", "model") if any(r["kind"] == k for r in rows)]
    colors = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(mechs)}
    single = len(lengths) == 1
    height = max(4.5, 0.22 * len(mechs) * len(kinds)) if single else 5.5
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels) + (0 if single else 3), height),
                             squeeze=False)
    for ax, (field, title) in zip(axes[0], panels):
        if single:
            for k, kind in enumerate(kinds):
                vals = {r["mechanism"]: r[field] for r in rows if r["kind"] == kind and r.get(field) is not None}
                ys = [i + k / (len(kinds) + 1) for i, m in enumerate(mechs) if m in vals]
                ax.barh(ys, [vals[m] for m in mechs if m in vals], height=1 / (len(kinds) + 1),
                        label=kind, hatch=("", "//", "..", "xx")[k])
            ax.set_yticks(range(len(mechs)), mechs, fontsize=8)
            ax.invert_yaxis()
            ax.set_title(f"{title}, n={lengths[0]}")
            if field in RATIOS:
                ax.axvline(1.0, color="k", lw=0.8)
            ax.legend(fontsize=8)
            continue
        for mech in mechs:
            for kind in kinds:
                pts = sorted((r for r in rows if r["mechanism"] == mech and r["kind"] == kind
                              and r.get(field) is not None), key=lambda r: r["n"])
                if pts:
                    ax.plot([r["n"] for r in pts], [r[field] for r in pts],
                            {"layer": "-", "op": "--", "peer": ":", "model": "-."}[kind], marker="o", ms=3,
                            color=colors[mech], label=f"{mech} ({kind})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length n")
        ax.set_title(title)
        if field == "peak_mem_mb":
            ax.set_yscale("log")
        elif field in RATIOS:
            ax.axhline(1.0, color="k", lw=0.8)
    for ax in axes[0]:
        ax.grid(alpha=0.3)
    if not single:
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center right", fontsize=6, ncol=2 if len(labels) > 24 else 1)
        fig.tight_layout(rect=(0, 0, 0.8, 1))
    else:
        fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ordered(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    kind_order = {"layer": 0, "op": 1, "peer": 2}
    return sorted(rows, key=lambda r: (kind_order.get(r["kind"], 3), r.get("causal", False), r["n"],
                                       r.get("batch", 1), r["mechanism"] != "sdpa"))
