"""``posattn report`` of the GPU benchmark recipes (``gpu_layer_bench``, ``gpu_layer_ab``,
``gpu_model_bench``, ``gpu_profile``, ``gpu_sweep_throughput``): their tables, the profiled steps, the GPU targets
judged, the setups the layer grid still lacks, and a sweep's cells per hour before and after,
from the results store's records (:mod:`.store`, :mod:`.throughput`).

Every number is a record's bench row as it was measured: a ratio (``train_ratio`` to plain SDPA,
``speed_vs_hf_bert``, ``vs_posattn_encoder``...) was formed in the run that timed both sides, in
interleaved rounds, and is shown as stored, never formed here from two records. Each table
lists the provenance (date, hardware, command) of the records it shows. The tables, the
targets of ``posattn bench`` and the plot are :mod:`.report`'s; the missing setups are
:func:`.gpu_check.layer_todo`'s, for the hardware the records were measured on.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from ..errors import PositionError
from ..experiments import store
from ..runtime.files import write_json_atomic
from .models import HF_MODELS, model_name
from .report import (
    COLUMNS,
    LAYER_TARGET_N,
    LAYER_TARGETS,
    MODEL_COLUMNS,
    SCORE_TERM_GRID_BY_CLASS,
    by_mechanism,
    grid_targets,
    plot,
    table,
    targets,
)
from .spec import BASELINE, fields_text, without_arm
from .store import LAYER_RECIPE, MODEL_RECIPE

# GPU target, whole encoder: a score-term mechanism's step ≤ 1.10× the posattn encoder with
# ``absolute`` (same run), the convolutions and CAT ≤ 1.25×: the pretraining-shape grid's split of the cost classes.
MODEL_TARGETS: dict[str, float] = {name: train for name, (train, _) in by_mechanism(SCORE_TERM_GRID_BY_CLASS).items()}
# the layer table's columns per length, as ``posattn bench`` formats them
LAYER_FIELDS = ("train_ms", "train_ratio", "infer_ms", "infer_ratio")
VS_ABSOLUTE = ("vs_posattn_encoder", "step ÷ posattn absolute", "{:.2f}")
REFERENCE = model_name("posattn_encoder")  # the encoder with its default mechanism, absolute


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def fenced(text: str) -> list[str]:
    """A plain-text table as a Markdown code block (its columns stay aligned)."""
    return ["```", text, "```", ""]


def provenance_lines(records: list[dict[str, Any]]) -> list[str]:
    """One line per (date, hardware, command) among ``records``, with how many records it made."""
    counts = Counter((r["provenance"]["date"], r["provenance"]["hardware"], r["provenance"]["command"])
                     for r in records)
    return [f"- {date}, {hw}: `{command}` ({k} record{'s' * (k != 1)})"
            for (date, hw, command), k in sorted(counts.items())]


# -- the layer bench ------------------------------------------------------------------------------
def layer_groups(records: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The records by setup but for the case and the length: (title, records), eager first."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in records:
        res = r["result"]
        key = (res["hardware"], res["dtype"], res["mode"] != "eager", res["mode"], res["batch"], res["heads"],
               res["head_dim"], res["causal"], res["dropout"],
               fields_text(dict(sorted((res.get("policy") or {}).items()))))
        groups.setdefault(key, []).append(r)
    out = []
    for (hw, dtype, _, mode, batch, heads, head_dim, causal, dropout, policy), group in sorted(groups.items()):
        title = (f"{hw}, {dtype}, {mode}, batch {batch} ({heads} heads × {head_dim}"
                 f"{', causal' if causal else ''}{f', dropout {dropout}' if dropout else ''})"
                 f"{f', fast path under {policy}' if policy else ''}")
        out.append((title, group))
    return out


def baseline_text(group: list[dict[str, Any]]) -> str:
    """What the rows' ``×`` divides by: plain SDPA on the backend the run allowed."""
    backend = (group[0]["result"].get("policy") or {}).get("sdpa_backend", "auto")
    return "PyTorch's own choice of SDPA kernel" if backend == "auto" else f"SDPA on its {backend} kernel alone"


def layer_table(records: list[dict[str, Any]]) -> str:
    """Every mechanism (plain SDPA first) × every length: training step and inference, in ms and
    as the ratio to plain SDPA measured in the same run."""
    lengths = sorted({r["result"]["n"] for r in records})
    formats = {c[0]: c for c in COLUMNS}
    columns = [formats["mechanism"]]
    for n in lengths:
        columns += [(f"{f}@{n}", f"n={n} {formats[f][1]}" if i == 0 else formats[f][1], formats[f][2])
                    for i, f in enumerate(LAYER_FIELDS)]
    rows: dict[str, dict[str, Any]] = {}
    for r in records:
        res = r["result"]
        row = rows.setdefault(res["case"], {"mechanism": res["case"]})
        row.update({f"{f}@{res['n']}": res["row"].get(f) for f in LAYER_FIELDS})
    return table(sorted(rows.values(), key=lambda r: (r["mechanism"] != BASELINE, r["mechanism"])), columns)


def layer_verdicts(records: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(the GPU layer target at n = 4096, with its mechanisms that have no record there; the
    targets of ``posattn bench`` that these rows can check), one line per verdict."""
    rows = sorted((r["result"]["row"] for r in records), key=lambda r: (r["n"], r["mechanism"]))
    ours = []
    for r in rows:
        goal = LAYER_TARGETS.get(r["mechanism"])
        if goal is not None and r["n"] == LAYER_TARGET_N and r.get("train_ratio") is not None:
            ours.append(f"train ×{r['train_ratio']:.2f} ≤ {goal} at n={LAYER_TARGET_N} batch={r['batch']} (layer): "
                        f"{r['mechanism']}: {verdict(r['train_ratio'] <= goal)}")
    unmeasured = sorted(set(LAYER_TARGETS) - {r["mechanism"] for r in rows if r["n"] == LAYER_TARGET_N})
    if unmeasured and any(r["n"] == LAYER_TARGET_N for r in rows):  # a table of other lengths: not its business
        ours.append(f"at n={LAYER_TARGET_N}, no record yet: {', '.join(unmeasured)}")
    return ours, targets(rows, {})


def layer_missing(records: list[dict[str, Any]], root: str | Path | None) -> list[str]:
    """Per hardware of the records and per mode, how many setups of the full grid (every
    registered mechanism × :data:`.gpu_check.SHAPES`, eager and compiled) have no record, and
    the next few, as the GPU command would measure them."""
    from .. import mechanisms as registry
    from .gpu_check import Settings, layer_todo, mode_name

    s = Settings(out=Path("."), results=store.results_root(root))
    shapes = ", ".join(f"n={n} batch={b}" for n, b in s.shapes)
    total = len(registry.names()) * len(s.shapes)
    lines = [(f"The grid of the GPU command: every registered mechanism ({len(registry.names())}) × ({shapes}), "
              f"bfloat16, eager and compiled (`torch.compile` mode {s.compile_mode}); {total} setups per mode."), ""]
    for hw in sorted({r["result"]["hardware"] for r in records}):
        for mode in ("eager", s.compile_mode):
            todo = layer_todo(s, mode, hw)
            count = sum(len(mechs) for _, mechs, policy in todo if not policy)
            target = sum(len(mechs) for _, mechs, policy in todo if policy)
            line = f"- {hw}, {mode_name(mode)}: {count} of {total} setups missing"
            if target:
                line += f" (and {target} of the target run against FlashAttention-backed SDPA)"
            if todo:
                line += "; next: " + "; ".join(f"n={sizes.max_len} batch={sizes.batch}"
                                               + (f" {fields_text(policy)}" if policy else "")
                                               + f": {', '.join(mechs)}" for sizes, mechs, policy in todo[:3])
            lines.append(line)
    return lines


def layer_report(recipe: str, records: list[dict[str, Any]], root: str | Path | None, out: Path | None) -> list[str]:
    """Per setup group its table, provenance, targets (and plot, with ``out``); then the grid's missing setups."""
    lines = [f"# {recipe}: one attention block against plain SDPA", "",
             ("Training step and inference per mechanism and length; × is the ratio to the plain SDPA timed in the "
              "same run (interleaved rounds); the sdpa row shown is from the run that stored it first."), ""]
    for k, (title, group) in enumerate(layer_groups(records), 1):
        ours, bench = layer_verdicts(group)
        lines += [f"## {title}", "", *fenced(layer_table(group)), "Provenance:", *provenance_lines(group), "",
                  f"GPU targets (bf16; × {baseline_text(group)}, where the target names FlashAttention-backed SDPA):",
                  *(f"- {v}" for v in ours or [f"none of these rows is at n={LAYER_TARGET_N}"]),
                  ""]
        if bench:
            lines += ["The CPU targets of `posattn bench` (set in fp32) on these rows:",
                      *(f"- {v}" for v in bench), ""]
        if out is not None:
            plot([r["result"]["row"] for r in group], out / f"layer-{k}.png")
            lines += [f"![{title}](layer-{k}.png)", ""]
    if recipe == LAYER_RECIPE:  # the grid is the GPU command's layer stages' (an A/B recipe has none)
        lines += ["## Setups of the grid still missing", "", *layer_missing(records, root)]
    return lines


# -- the model bench ------------------------------------------------------------------------------
def model_mechanism(label: str) -> str | None:
    """The mechanism of a model case's label (``posattn_encoder(alibi)`` -> ``alibi``), None for a
    model with its default mechanisms or a Hugging Face model."""
    _, paren, inner = without_arm(label).partition("(")   # "posattn_encoder(alibi) [arm]" too
    return inner[:-1] if paren else None


def model_runs(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The records by the run that measured them (same date, hardware and command)."""
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in records:
        p = r["provenance"]
        runs.setdefault((p["date"], p["hardware"], p["command"]), []).append(r)
    return [group for _, group in sorted(runs.items())]


def model_columns(rows: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """:data:`.report.MODEL_COLUMNS` and the step ÷ posattn absolute, those these rows fill; a peer
    column's header says whether it is speed or memory (its neighbour may be left out)."""
    columns = []
    for key, head, fmt in [*MODEL_COLUMNS, VS_ABSOLUTE]:
        if any(r.get(key) is not None for r in rows):
            what = key.split("_vs_")[0] if "_vs_" in key else ""
            columns.append((key, f"{what} {head}" if what and not head.startswith(what) else head, fmt))
    return columns


def model_verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The GPU whole-model targets that one run's rows can check: posattn against its Hugging
    Face peer in tokens/s (:func:`.report.grid_targets`), a score-term encoder's step against the
    posattn encoder with ``absolute``."""
    out = grid_targets(rows)
    for r in rows:
        goal = MODEL_TARGETS.get(model_mechanism(r["mechanism"]) or "")
        if goal is not None and r.get("vs_posattn_encoder") is not None:
            out.append(f"{r['mechanism']} step ÷ posattn absolute = {r['vs_posattn_encoder']:.2f} ≤ {goal} "
                       f"at n={r['n']} batch={r['batch']}: {verdict(r['vs_posattn_encoder'] <= goal)}")
    return out


def model_missing(records: list[dict[str, Any]], root: str | Path | None) -> list[str]:
    """Per hardware of the records, the GPU command's model runs with a record missing (a run is
    measured whole: its reference is timed again beside the missing ones)."""
    from .cases import CaseSpec
    from .gpu_check import Settings, model_todo

    s = Settings(out=Path("."), results=store.results_root(root))
    lines = []
    for hw in sorted({r["result"]["hardware"] for r in records}):
        todo = model_todo(s, hw)
        if todo:
            runs = ("; ".join(", ".join(CaseSpec("model", name, 0).label for name in group) for group in todo))
            lines.append(f"- {hw}: {len(todo)} run(s): {runs}")
    return lines


def model_report(recipe: str, records: list[dict[str, Any]], root: str | Path | None,
                 out: Path | None) -> list[str]:
    """Per run its table, provenance and targets; with ``out``, one plot of every model; then the
    GPU command's runs still missing."""
    lines = [f"# {recipe}: whole models against Hugging Face and against posattn absolute", "",
             ("Per run: step time, training tokens/s, inference and peak memory; speed ÷ BERT/Llama is the Hugging "
              "Face model's step time ÷ posattn's (> 1: posattn faster), step ÷ posattn absolute a score-term "
              "encoder's step ÷ the encoder with `absolute`, each timed in that run."), ""]
    for k, group in enumerate(model_runs(records), 1):
        rows = sorted((r["result"]["row"] for r in group), key=lambda r: (r["mechanism"] in HF_MODELS, r["mechanism"]))
        names = [r["mechanism"] for r in rows]
        lines += [f"## Run {k}: {', '.join(names)}", "", *fenced(table(rows, model_columns(rows)))]
        if any(r.get("vs_posattn_encoder") is not None for r in rows) and REFERENCE not in names:
            lines += [(f"{REFERENCE} (`absolute`) was timed in this run as the reference of step ÷ posattn absolute; "
                       f"its stored record comes from another run (the store keeps a setup's first measurement)."), ""]
        lines += ["Provenance:", *provenance_lines(group), "",
                  "GPU targets (bf16):",
                  *(f"- {v}" for v in model_verdicts(rows) or ["none of these rows has a target"]), ""]
    if out is not None and records:
        plot([r["result"]["row"] for r in records], out / "models.png")
        lines += ["![tokens/s and peak memory of every model](models.png)", ""]
    missing = model_missing(records, root) if recipe == MODEL_RECIPE else []
    if missing:
        lines += ["## Runs still missing", "",
                  "The GPU command's `models` stage measures these next (records removed when a default they "
                  "depended on changed come back here):", "", *missing, ""]
    return lines


# -- profiles -------------------------------------------------------------------------------------
def profile_report(recipe: str, records: list[dict[str, Any]]) -> list[str]:
    """Per setup group (hardware, bench, n, batch, size): each case's profiled training step,
    plain SDPA or the Hugging Face model first, with the step time and ratio of that run."""
    from .profile import profile_lines

    lines = [f"# {recipe}: where a training step's time goes", "",
             ("One training step per case under `torch.profiler` after a timed one: on a GPU the kernels' time, "
              "attributed to the operator that launched them (`ops`) and by kernel (`kernels`, whose names say "
              "which attention backend ran); shares are of the step's total on that clock. The step time and "
              "× SDPA are from the single timed round of the same run (noisier than the benchmark's medians)."), ""]
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in records:
        res = r["result"]
        groups.setdefault((res["hardware"], res["bench"], res["dtype"], res["n"], res["batch"], res["heads"],
                           res["head_dim"], res["layers"], res["dropout"]), []).append(r)
    for (hw, bench, dtype, n, batch, heads, head_dim, layers, dropout), group in sorted(groups.items()):
        what = "one attention block" if bench == "layer" else f"whole models, {layers} layers"
        lines += [f"## {hw}, {dtype}: {what}, n {n}, batch {batch} ({heads} heads × {head_dim}"
                  f"{f', dropout {dropout}' if dropout else ''})", ""]
        text: list[str] = []
        first = (BASELINE, *HF_MODELS, REFERENCE)
        for r in sorted(group, key=lambda r: (r["result"]["case"] not in first, r["result"]["case"])):
            row = r["result"]["row"]
            step = f", step {row['train_ms']:.1f} ms" if row.get("train_ms") is not None else ""
            ratio = f" (× SDPA {row['train_ratio']:.2f})" if row.get("train_ratio") is not None else ""
            where = profile_lines("  profiled", row["profile"]) if row.get("profile") else ["  no profile"]
            text += [f"{row['mechanism']} [path {row.get('path') or '-'}{step}{ratio}]", *where, ""]
        lines += fenced("\n".join(text).rstrip())
        lines += ["Provenance:", *provenance_lines(group), ""]
    return lines


# -- sweep throughput -----------------------------------------------------------------------------
def throughput_groups(records: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The records by cell and measuring run (hardware, cell, timed steps, warm-up, threads):
    (title, records), each group's settings by workers within mode, eager first."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in records:
        res = r["result"]
        groups.setdefault((res["hardware"], res["recipe"], res["cell"], res["steps"], res["warmup"], res["threads"]),
                          []).append(r)
    out = []
    for (hw, recipe, cell, steps, warmup, threads), group in sorted(groups.items()):
        group.sort(key=lambda r: (r["result"]["mode"] != "eager", r["result"]["mode"], r["result"]["workers"]))
        row = group[0]["result"]["row"]
        title = (f"{hw}: {recipe} {row['label']} n={row['train_length']} d={row['d_model']} (cell {cell}; "
                 f"{steps} timed steps after {warmup}, {threads} thread(s) per worker)")
        out.append((title, group))
    return out


def throughput_report(recipe: str, records: list[dict[str, Any]]) -> list[str]:
    """Per cell and hardware: every setting's row, the baseline's cells per hour (1 worker, eager)
    and the best setting's, each ratio as measured in its run."""
    from .throughput import COLUMNS as THROUGHPUT_COLUMNS
    from .throughput import break_even_steps, cell_rate, cells_per_hour_started

    lines = [f"# {recipe}: cells of a compare sweep per hour, by workers per device and compile mode", "",
             ("Cells per hour = aggregate training steps/s × 3600 ÷ the cell's configured steps (its full budget); "
              "× baseline is a setting's cells per hour ÷ one eager worker's, timed in the same run; cells/h +eval "
              "also counts the cell's validation passes at their measured share, and cells/h +eval +start each "
              "cell's start-up too (its warm-up in a fresh worker: the model built and, compiled, the step compiled; "
              "`compare`'s workers keep a compiled step for their next cell of the same shape, so a sweep pays the "
              "compilation once per worker and shape, and this column is the bound for its first cells). A cell "
              "that stops early pays the same start-up for fewer steps."), ""]
    for title, group in throughput_groups(records):
        rows = [{**r["result"]["row"], "cells_per_hour_started": cells_per_hour_started(r["result"]["row"])}
                for r in group]
        base = next((r for r in rows if r["workers"] == 1 and r["mode"] == "eager"), None)
        best = max(rows, key=lambda r: r["cells_per_hour"])
        lines += [f"## {title}", "", *fenced(table(rows, THROUGHPUT_COLUMNS[3:]))]
        if base is not None:
            lines.append(f"- before (1 worker, eager): {base['cells_per_hour']:.1f} cells/h")
        lines.append(f"- best ({best['workers']} worker(s), {best['mode']}): {best['cells_per_hour']:.1f} cells/h "
                     f"(× {best['vs_baseline']:.2f} the baseline of its run)")
        eager = [r for r in rows if r["mode"] == "eager"]
        comp = [r for r in rows if r["mode"] != "eager"]
        if eager and comp:  # start-up counted: which wins depends on how many steps a cell trains
            e = max(eager, key=lambda r: r["cells_per_hour_started"])
            c = max(comp, key=lambda r: r["cells_per_hour_started"])
            at = break_even_steps(e, c)
            longer = c["workers"] * cell_rate(c) > e["workers"] * cell_rate(e)  # the compiled step wins long cells
            lines.append(f"- start-up counted, at the full budget: {e['workers']} eager worker(s) "
                         f"{e['cells_per_hour_started']:.1f} cells/h, {c['workers']} worker(s) {c['mode']} "
                         f"{c['cells_per_hour_started']:.1f}; "
                         + ("the same winner at every number of steps" if at is None else
                            f"the compiled step trains more cells {'from' if longer else 'up to'} "
                            f"{at:.0f} steps per cell"))
        lines += ["", "Provenance:", *provenance_lines(group), ""]
    return lines


def report(recipe: str, config: dict[str, Any], root: str | Path | None, out: Path | None) -> str:
    """The report of a bench recipe (its ``recipe.json`` config names the bench: ``layer``,
    ``model`` or ``throughput``); with ``out``, the plots and results.json are written there too."""
    records = store.load(recipe, root, kind="cell")
    bench = config.get("bench")
    if bench == "layer":
        lines = layer_report(recipe, records, root, out)
    elif bench == "model":
        lines = model_report(recipe, records, root, out)
    elif bench == "throughput":
        lines = throughput_report(recipe, records)
    elif bench == "profile":
        lines = profile_report(recipe, records)
    else:
        raise PositionError(f"results store: recipe {recipe!r} is a bench recipe of unknown bench {bench!r} "
                            f"(layer, model, profile or throughput)")
    if not records:
        lines.insert(2, "No records yet.\n")
    if out is not None:
        write_json_atomic(out / "results.json", {"name": recipe, "config": config, "records": records})
    return "\n".join(lines).rstrip() + "\n"
