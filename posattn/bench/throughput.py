"""``posattn bench-throughput``: how many cells of a compare sweep one machine trains per hour
(the CAT Fig 2 sweep's cells per GPU-hour), and which way of running them raises it.

A sweep's cells are small models (CAT Fig 2: d 32–128, one or two layers, n 64–256), so one of
them leaves a GPU mostly idle: its step is launch-bound. Two levers are measured here against
the baseline of one eager process:

- **several workers** per device: ``workers`` processes train at once (as ``posattn compare
  --workers`` runs cells), each its own copy of the cell's model;
- **the compiled step**: ``compile`` (a :mod:`posattn.runtime.compile` mode) for the training
  step's forward and backward.

A *setting* is (workers, compile). For each, every worker builds the cell's model, trains
``warmup`` untimed steps and evaluates the cell's validation set once (compilation and every
first-use cost happen there; their time is reported apart), waits for the others at a barrier,
then trains ``steps`` timed steps through :func:`posattn.synthetic.train.train` (no evaluation),
and finally times one more evaluation of the validation set, which stands for each of the cell's
evaluations. From the timed windows:

- steps/s per process (each worker's own window) and aggregate steps/s (all workers' steps over
  the span from the first start to the last end);
- **cells per hour** = aggregate steps/s × 3600 / the cell's configured steps (training only, the
  cell's full step budget: early stopping would only raise it);
- with evaluation: each cell also evaluates every ``eval_every`` steps; its measured share of a
  cell's time and the cells per hour it leaves are reported beside;
- the ratio of each setting's cells per hour to the baseline's (1 worker, eager), measured first
  in the same run, so that a ratio never mixes two runs.

Only the rows' training examples that the timed steps use are generated (the batches are drawn
the same way as from the full set), which changes no step's cost. Each setting is a results-store
record of :data:`RECIPE` (:func:`publish`) keyed by what determines its numbers (the cell, the
setting, the step counts, the hardware); ``posattn report gpu_sweep_throughput`` renders them
(:mod:`.records`). The prepared GPU command runs it as its ``throughput`` stage.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import queue as queues
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import PositionError, RunError
from ..options import add_device_option, add_json_option, add_threads_option, plain, positive_int
from ..runtime.compile import COMPILE_MODES

RECIPE = "gpu_sweep_throughput"  # the results-store recipe of the records
DEFAULT_RECIPE = "cat_fair_mqar"  # CAT Fig 2
PICKS = ("smallest", "middle", "largest")  # --cells by shape (train length, then width)
EAGER = "none"  # --compile-modes' name for the eager step
BARRIER_S = 900.0  # the longest a worker waits for the others (their data, build and compilation)


@dataclass(frozen=True)
class Setting:
    """How the cell is run: ``workers`` processes at once, the step compiled in ``compile`` (None: eager)."""

    workers: int
    compile: str | None = None

    @property
    def mode(self) -> str:
        """``eager`` or ``compile MODE`` (as the layer records of :mod:`.gpu_check` name modes)."""
        return "eager" if self.compile is None else f"compile {self.compile}"


BASELINE = Setting(1, None)


@dataclass(frozen=True)
class Job:
    """What one worker process does (picklable: workers are spawned)."""

    cell: Any  # a posattn.synthetic.compare.Cell
    index: int
    compile: str | None
    steps: int
    warmup: int
    device: str
    threads: int


# -- choosing cells ---------------------------------------------------------------------------------
def shape(cell: Any) -> tuple[int, int]:
    """A Fig 2 shape: (training length, model width)."""
    return cell.train_length, cell.d_model


def pick_cells(sweep: Any, picks: list[str]) -> list[Any]:
    """The cells of ``sweep`` that ``picks`` name: ``smallest``, ``middle``, ``largest`` (a shape
    among the sweep's distinct shapes ordered by length then width; its first cell in the sweep's
    order, i.e. the first model, learning rate and seed) or a cell id. One error names every bad pick."""
    shapes = sorted({shape(c) for c in sweep.cells})
    by_id = {c.id: c for c in sweep.cells}
    chosen, bad = [], []
    for pick in picks:
        if pick in PICKS:
            target = shapes[{"smallest": 0, "middle": len(shapes) // 2, "largest": -1}[pick]]
            cell = next(c for c in sweep.cells if shape(c) == target)
        elif pick in by_id:
            cell = by_id[pick]
        else:
            bad.append(pick)
            continue
        if cell not in chosen:
            chosen.append(cell)
    if bad:
        raise PositionError(f"bench-throughput --cells: {', '.join(map(repr, bad))} is not a cell of {sweep.name} "
                            f"({len(sweep.cells)} cells); use {', '.join(PICKS)} or a cell id such as "
                            f"{sweep.cells[0].id}")
    return chosen


def settings(workers: list[int], compiles: list[str]) -> list[Setting]:
    """Every (workers, compile) of the two lists, the baseline (1 worker, eager) first whether
    asked for or not: the ratios are to it."""
    out = [BASELINE]
    for mode in compiles:
        for w in workers:
            s = Setting(w, None if mode == EAGER else mode)
            if s not in out:
                out.append(s)
    return out


# -- one worker -------------------------------------------------------------------------------------
def train_data(cell: Any, steps: int) -> Any:
    """The cell's training examples that ``steps`` steps of its batch size draw: the first ones of
    its training set (a step's cost depends on the batch's shape only)."""
    batch = cell.training["batch_size"]
    return cell.data("train", cell.train_length, min(cell.examples["train"], batch * max(1, steps)))


def work(job: Job, barrier: Any, results: Any) -> None:
    """One worker (a spawned process): warm up, wait for the others, time ``job.steps`` steps,
    wait again, time one validation pass; puts its timings (or its error) on ``results``."""
    import torch

    from ..models import build_model
    from ..synthetic.train import TrainConfig, evaluate, train

    try:
        torch.set_num_threads(job.threads)
        cell, warmup = job.cell, max(1, job.warmup)
        cfg = replace(TrainConfig(**cell.training), target_accuracy=None)
        data = train_data(cell, warmup + job.steps)
        torch.manual_seed(cfg.seed + job.index)
        model = build_model(cell.model_config())
        run = dict(device=job.device, progress=False, compile=job.compile)
        valid = cell.data("valid", cell.train_length, cell.examples["valid"])
        t0 = time.monotonic()
        train(model, data, replace(cfg, steps=warmup, eval_every=warmup), **run)
        # a first pass pays what a cell pays once (lazily loaded kernels, the eager path's first
        # use after a compiled step): timed, it would count that once-only cost at every evaluation
        evaluate(model, valid, cfg.eval_batch_size, job.device)
        warm = time.monotonic() - t0
        barrier.wait(BARRIER_S)
        start = time.monotonic()
        train(model, data, replace(cfg, steps=job.steps, eval_every=job.steps), **run)
        end = time.monotonic()
        barrier.wait(BARRIER_S)
        t0 = time.monotonic()
        evaluate(model, valid, cfg.eval_batch_size, job.device)
        results.put({"index": job.index, "warmup_s": warm, "start": start, "end": end,
                     "eval_s": time.monotonic() - t0})
    except threading.BrokenBarrierError:
        results.put({"index": job.index, "broken": True})  # another worker failed: its error is the one said
    except BaseException as e:  # noqa: BLE001 - reported by the parent, with the worker that failed
        barrier.abort()
        results.put({"index": job.index, "error": f"{type(e).__name__}: {e}"})


def run_workers(jobs: list[Job], target: Callable[[Job, Any, Any], None] = work) -> list[dict[str, Any]]:
    """Run one process per job at once (spawned: CUDA needs it) and return their reports by index.
    A worker that fails (or dies without a report) ends the setting with one RunError that names
    it; the others, stopped at their barrier, add nothing to it."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(len(jobs)), ctx.Queue()
    procs = [ctx.Process(target=target, args=(job, barrier, results), daemon=True) for job in jobs]
    for p in procs:
        p.start()
    reports: dict[int, dict[str, Any]] = {}
    try:
        while len(reports) < len(jobs):
            try:
                r = results.get(timeout=1.0)
            except queues.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            reports[r["index"]] = r
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    failed = [(i, r["error"]) for i, r in sorted(reports.items()) if "error" in r]
    failed += [(i, f"exited with code {procs[i].exitcode} without a report") for i in range(len(jobs))
               if i not in reports]
    if failed:
        i, why = failed[0]
        more = f" ({len(failed)} of {len(jobs)} workers failed)" if len(failed) > 1 else ""
        raise RunError(f"worker {i + 1} of {len(jobs)} failed: {why}{more}")
    return [reports[i] for i in range(len(jobs))]


# -- one setting's numbers --------------------------------------------------------------------------
def summarize(cell: Any, setting: Setting, steps: int, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """A setting's row from its workers' reports (see the module docstring for each number)."""
    cfg_steps, eval_every = cell.training["steps"], cell.training["eval_every"]
    rates = [steps / (r["end"] - r["start"]) for r in reports]
    span = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    aggregate = len(reports) * steps / span
    evals = math.ceil(cfg_steps / eval_every)
    # a cell's seconds per worker: its configured steps at the worker's rate, plus its evaluations
    cell_s = [cfg_steps / rate + evals * r["eval_s"] for rate, r in zip(rates, reports)]
    eval_share = sum(evals * r["eval_s"] / s for r, s in zip(reports, cell_s)) / len(reports)
    row = {"cell": cell.id, "label": cell.label, "train_length": cell.train_length, "d_model": cell.d_model,
           "layers": cell.layers, "batch_size": cell.training["batch_size"], "workers": setting.workers,
           "mode": setting.mode, "steps": steps, "cell_steps": cfg_steps,
           "steps_per_s": sum(rates) / len(rates), "aggregate_steps_per_s": aggregate,
           "cells_per_hour": aggregate * 3600 / cfg_steps,
           "eval_share": eval_share, "warmup_s": max(r["warmup_s"] for r in reports)}
    row["cells_per_hour_with_eval"] = row["workers"] * cell_rate(row) * 3600 / cfg_steps
    row["cells_per_hour_started"] = cells_per_hour_started(row)
    return row


def cells_per_hour_started(row: dict[str, Any], steps: int | None = None) -> float:
    """Cells per hour of a setting's row when every cell also pays its start-up (``warmup_s``:
    the model built and, compiled, the step compiled) and its validation passes (at their
    measured share): workers × 3600 ÷ (``steps``, by default the cell's budget, at a worker's
    rate, plus evaluation, plus start-up). A cell that stops early pays the same start-up for
    fewer steps, so the compiled step's start-up weighs more there. The start-up is a fresh
    worker's: ``compare``'s workers reuse a compiled step for the next cell of the same shape
    (on the CPU a later cell of one shape started in 0.5 s against 21 s for the first), so for
    a sweep this bounds its first cells per worker and shape."""
    steps = row["cell_steps"] if steps is None else steps
    return row["workers"] * 3600.0 / (steps / cell_rate(row) + row["warmup_s"])


def cell_rate(row: dict[str, Any]) -> float:
    """A worker's share of the aggregate training steps per second, its validation passes
    counted: aggregate steps/s ÷ ``workers`` × (1 − eval share). The aggregate is taken over the
    span from the first worker's start to the last one's end, as for ``cells_per_hour``, so that a
    straggler counts here too and the start-up column never exceeds ``cells_per_hour_with_eval``.
    ``workers`` × this decides which setting trains more of the longest cells."""
    return row["aggregate_steps_per_s"] / row["workers"] * (1.0 - row["eval_share"])


def break_even_steps(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """The steps per cell at which settings ``a`` and ``b`` train as many cells per hour, start-up
    counted (:func:`cells_per_hour_started`); None when one of them wins at every length."""
    ra, rb = cell_rate(a), cell_rate(b)
    slope = a["workers"] / rb - b["workers"] / ra        # a's cells/h against b's: seconds per step
    if slope == 0:
        return None
    steps = (b["workers"] * a["warmup_s"] - a["workers"] * b["warmup_s"]) / slope
    return steps if steps > 0 else None


def measure(cell: Any, setting: Setting, steps: int, warmup: int, device: str, threads: int,
            target: Callable[[Job, Any, Any], None] = work) -> dict[str, Any]:
    """One setting of one cell: its row (:func:`summarize`)."""
    jobs = [Job(cell, i, setting.compile, steps, warmup, device, threads) for i in range(setting.workers)]
    try:
        reports = run_workers(jobs, target)
    except RunError as e:
        raise RunError(f"bench-throughput: {cell.label} (cell {cell.id}, n={cell.train_length}, "
                       f"d={cell.d_model}), {setting.workers} worker(s), {setting.mode}: {e}") from None
    return summarize(cell, setting, steps, reports)


# -- the store --------------------------------------------------------------------------------------
def key(recipe: str, row: dict[str, Any], warmup: int, threads: int, hw: str) -> dict[str, Any]:
    """What determines a row's numbers: the record's id is its hash."""
    return {"bench": "throughput", "recipe": recipe, "cell": row["cell"], "workers": row["workers"],
            "mode": row["mode"], "steps": row["steps"], "warmup": warmup, "threads": threads, "hardware": hw}


def missing(recipe: str, cell: Any, wanted: list[Setting], steps: int, warmup: int, threads: int, hw: str,
            root: str | Path | None = None) -> list[Setting]:
    """The settings of ``cell`` that have no record on the hardware ``hw`` yet."""
    from ..experiments import store

    return [s for s in wanted
            if not store.record_path(RECIPE, store.content_id(key(recipe, {"cell": cell.id, "workers": s.workers,
                                                                              "mode": s.mode, "steps": steps},
                                                                  warmup, threads, hw)), root).exists()]


def publish(recipe: str, row: dict[str, Any], warmup: int, threads: int, prov: dict[str, str],
            root: str | Path | None = None) -> bool:
    """Store ``row`` as a record (the recipe's ``recipe.json`` with it); False if it was there."""
    from ..experiments import store
    from .store import publish_recipe

    publish_recipe(RECIPE, "throughput", prov, root)
    k = key(recipe, row, warmup, threads, prov["hardware"])
    return store.publish(RECIPE, store.content_id(k), {**k, "row": row}, prov, root=root)


# -- a whole run ------------------------------------------------------------------------------------
def command_line(recipe: str, cells: list[str], wanted: list[Setting], steps: int, warmup: int, device: str,
                 threads: int) -> str:
    """The ``posattn bench-throughput`` command that measures ``wanted`` (the records' provenance)."""
    workers = sorted({s.workers for s in wanted})
    modes = list(dict.fromkeys(s.compile or EAGER for s in wanted))
    return (f"posattn bench-throughput {recipe} --cells {' '.join(cells)} "
            f"--worker-counts {' '.join(map(str, workers))} --compile-modes {' '.join(modes)} --steps {steps} "
            f"--warmup {warmup} --device {device} --threads {threads}")


def bench(recipe: str, picks: list[str], wanted: list[Setting], steps: int, warmup: int, device: str = "auto",
          threads: int = 1, root: str | Path | None = None, store_rows: bool = True, skip_stored: bool = False,
          log: Callable[[str], None] | None = None, errors: list[str] | None = None,
          attempt: Callable[[Setting], AbstractContextManager[Any]] | None = None) -> list[dict[str, Any]]:
    """Measure every setting of ``wanted`` (the baseline first) on each picked cell of the compare
    recipe ``recipe``; each row gets ``vs_baseline`` (its cells per hour ÷ the baseline's, same run)
    and, with ``store_rows``, is stored as soon as it is measured. ``skip_stored``: a cell whose
    settings all have records is not measured (the GPU command's next window measures the rest).
    A failed setting raises its RunError, or with ``errors`` is appended there and the next one
    runs (a failed baseline skips its cell: no ratio could be formed). ``attempt(setting)``: a
    context each setting is measured and stored in (the GPU command's ledger of unfinished units),
    whose value's ``fail()`` is called when the setting fails."""
    from ..experiments.store import hardware, provenance
    from ..runtime.compile import check_mode
    from ..runtime.device import resolve_device
    from ..synthetic.compare import load_config, validate_config

    for s in wanted:
        check_mode(s.compile, "bench-throughput --compile-modes")
        if s.workers < 1:
            raise PositionError(f"bench-throughput --worker-counts: must be >= 1, got {s.workers}")
    if steps < 1 or warmup < 1:
        raise PositionError(f"bench-throughput: --steps and --warmup must be >= 1, got {steps} and {warmup}")
    sweep = validate_config(load_config(recipe))
    cells, name = pick_cells(sweep, picks), sweep.name  # records name the sweep, not the file it came from
    wanted = [BASELINE, *[s for s in wanted if s != BASELINE]]
    device = str(resolve_device(device))
    hw = hardware(device)
    prov = provenance(command_line(recipe, picks, wanted, steps, warmup, device, threads), device)
    say = log or (lambda msg: None)
    rows: list[dict[str, Any]] = []
    for cell in cells:
        todo = missing(name, cell, wanted, steps, warmup, threads, hw, root) if skip_stored else wanted
        if not todo:
            say(f"{cell.label} n={cell.train_length} d={cell.d_model}: every setting in the store")
            continue
        base = None
        for setting in [BASELINE, *[s for s in todo if s != BASELINE]]:
            say(f"{cell.label} n={cell.train_length} d={cell.d_model}: {setting.workers} worker(s), {setting.mode}")
            with (attempt or (lambda _: nullcontext()))(setting) as tried:
                try:
                    row = measure(cell, setting, steps, warmup, device, threads)
                except RunError as e:
                    if errors is None:
                        raise
                    errors.append(str(e))
                    say(str(e))
                    row = None
                    if tried is not None:
                        tried.fail()
                if row is not None:
                    base = base or row
                    row["vs_baseline"] = row["cells_per_hour"] / base["cells_per_hour"]
                    row["recipe"], row["device"] = name, device
                    rows.append(row)
                    if store_rows:
                        publish(name, row, warmup, threads, prov, root)
            if row is None and base is None:
                break
    return rows


COLUMNS = [("label", "cell", "{}"), ("train_length", "n", "{}"), ("d_model", "d", "{}"),
           ("workers", "workers", "{}"), ("mode", "mode", "{}"), ("steps_per_s", "steps/s/proc", "{:.1f}"),
           ("aggregate_steps_per_s", "steps/s all", "{:.1f}"), ("cells_per_hour", "cells/h", "{:.1f}"),
           ("vs_baseline", "× baseline", "{:.2f}"), ("eval_share", "eval share", "{:.0%}"),
           ("cells_per_hour_with_eval", "cells/h +eval", "{:.1f}"), ("warmup_s", "warm-up s", "{:.1f}"),
           ("cells_per_hour_started", "cells/h +eval +start", "{:.1f}")]


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as aligned text: one line per (cell, setting)."""
    from .report import table as aligned

    return aligned(rows, COLUMNS)


def command(args: argparse.Namespace) -> None:
    """``posattn bench-throughput``: measure, store, print the table (or the rows as JSON)."""
    import json

    wanted = settings(sorted(set(args.worker_counts)), list(dict.fromkeys(args.compile_modes)))
    rows = bench(args.recipe, args.cells, wanted, args.steps, args.warmup, args.device, args.threads,
                 root=args.results, store_rows=not args.no_store,
                 log=lambda msg: print(f"[bench-throughput] {msg}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(table(rows))
    if not args.no_store:
        from ..experiments.store import results_root

        print(f"\nrecords in {results_root(args.results) / RECIPE}/ (posattn report {RECIPE})")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``posattn bench-throughput``."""
    p = sub.add_parser("bench-throughput", help="cells per hour of a compare sweep: several workers per device "
                       "and the compiled step against one eager process", description=plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE,
                   help=f"a compare config: a built-in name or a YAML file (default {DEFAULT_RECIPE}, CAT Fig 2)")
    p.add_argument("--cells", nargs="+", default=["largest", "middle"], metavar="CELL",
                   help=f"cells to measure: {', '.join(PICKS)} (by shape) or cell ids (default largest middle)")
    p.add_argument("--worker-counts", nargs="+", type=positive_int, default=[1, 2, 4],
                   help="processes training at once (default 1 2 4)")
    p.add_argument("--compile-modes", nargs="+", choices=[EAGER, *COMPILE_MODES], default=[EAGER, "default"],
                   metavar="MODE", help=f"the step eager ({EAGER}) or compiled: {', '.join(COMPILE_MODES)} "
                                        f"(default {EAGER} default)")
    p.add_argument("--steps", type=positive_int, default=200, help="timed steps per worker (default 200)")
    p.add_argument("--warmup", type=positive_int, default=5,
                   help="untimed steps first, compilation included (default 5)")
    add_device_option(p)
    add_threads_option(p)
    p.add_argument("--results", default=None,
                   help="the results store's folder (default $POSATTN_RESULTS, else results)")
    p.add_argument("--no-store", action="store_true", help="print the numbers only, store no record")
    add_json_option(p)
    p.set_defaults(func=command)
