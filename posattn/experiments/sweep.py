"""One runner for every sweep: ``posattn compare``, ``finetune``, ``pretrain RECIPE`` and ``study table3``.

A sweep is a :class:`Recipe`: its :class:`Cell`\\ s and how to run one, read a finished one back
and write the summary of the finished ones (``results.json``, ``report.md``, plots). :func:`run`
does the rest the same way for every sweep:

- **resume**: a cell whose result is on file is read back and never handed to the executor (a
  recipe whose cells check themselves when resumed hands them over anyway: ``skip_finished``);
- **waves**: the cells of a wave start once every cell of the waves before it has finished
  (fine-tuning: an intermediate task's models start the cells of the tasks it initialises);
- **the executor** (:mod:`posattn.experiments.executors`) says where the cells run; its time
  budget leaves the cells it keeps from starting to the next invocation: the summary says it is
  partial and :func:`~posattn.experiments.executors.budget_note` says how many remain;
- **cells finished elsewhere** (``stored``: the results store's records of this sweep, by id) count
  as finished and are not run; the summary holds them with the cells of the run folder;
- **report only**: run nothing, summarise the cells finished so far (one ConfigError if none is);
- ``config.yaml`` (the sweep's normalized config, for recipes that have one) written atomically,
  in a folder that holds no other sweep's run, and a progress bar over the cells.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from posattn.errors import PositionError
from posattn.experiments.config import ConfigError, read_yaml
from posattn.experiments.executors import Executor, LocalExecutor, NotStarted, budget_note
from posattn.runtime.checkpoint import check_config
from posattn.runtime.files import write_text_atomic


@dataclass(frozen=True)
class Cell:
    """One unit of a sweep as the runner sees it.

    ``id``: what the cell is known by (a hash of its content for compare and fine-tuning, so that
    a changed setting is a new cell); ``label``: how progress, errors and the time budget name it;
    ``job``: what the recipe's ``run_cell`` and ``read_cell`` take (picklable: it travels to worker
    processes and Slurm tasks); ``wave``: cells of a wave start after every cell of a lower one."""

    id: str
    label: str
    job: Any
    wave: int = 0


@dataclass(frozen=True)
class Recipe:
    """What the runner needs of a sweep.

    ``run_cell(job, in_worker)`` runs one cell and returns its result record, and
    ``read_cell(job)`` reads a finished cell's record back (None while it is not finished); both
    must be module-level functions, since worker processes import them. ``write_summary(results,
    total, out)`` writes the summary of the finished cells' ``results`` (fewer than ``total``: a
    partial one) into ``out``. ``title`` names the sweep in messages ("sweep 'tiny'"); ``config``
    is written to ``config.yaml`` (None: no file); ``cell_store`` is the folder of the cells when
    it is not the output folder; ``unit`` counts the cells in messages ("cells", "runs").
    ``skip_finished=False``: finished cells go to ``run_cell`` too, for cells that check
    themselves on resume (a pretraining run verifies its config and repairs a damaged model).
    ``summary_each_cell``: rewrite the summary after every finished cell as well (cells that take
    long: the partial summary stays if the command is killed)."""

    title: str
    cells: Sequence[Cell]
    run_cell: Callable[[Any, bool], dict[str, Any]]
    read_cell: Callable[[Any], dict[str, Any] | None]
    write_summary: Callable[[list[dict[str, Any]], int, Path], None]
    config: dict[str, Any] | None = None
    cell_store: Path | None = None
    unit: str = "cells"
    skip_finished: bool = True
    summary_each_cell: bool = False


def _check_folder(out: Path, recipe: Recipe) -> None:
    """One error (:func:`~posattn.runtime.checkpoint.check_config`) if ``out`` holds the run of
    another sweep (another name in its ``config.yaml``): its config, summary and cells are not this
    sweep's to overwrite or resume. A changed config of the same sweep is fine: its cells are new
    ids beside the old ones."""
    path = out / "config.yaml"
    if path.is_file():
        check_config({"name": read_yaml(path).get("name")}, {"name": recipe.config.get("name")}, path)


def run(recipe: Recipe, out: str | Path, executor: Executor | None = None, *, progress: bool = True,
        report_only: bool = False, only: Collection[str] | None = None,
        stored: Mapping[str, dict[str, Any]] | None = None,
        on_cell: Callable[[str, dict[str, Any]], Any] | None = None) -> list[dict[str, Any]]:
    """Run every unfinished cell of ``recipe`` (wave by wave) through ``executor`` (default: one
    after another in this process), write the summary into ``out`` and return the finished cells'
    records: wave by wave, in the order of the cells within a wave.

    ``only``: ids of the cells to run now; the others are read back, not run, and the summary
    holds every finished cell (a sweep split over time or machines). ``stored``: result records of
    cells finished elsewhere, by cell id (the results store); a cell the run folder has not
    finished but ``stored`` has is finished. ``on_cell(id, record)``: called as each cell this run
    trains finishes (e.g. to publish it at once). ``report_only``: run nothing, summarise the cells
    finished so far, in the order of the cells; ConfigError if there are none."""
    out, total, stored = Path(out), len(recipe.cells), stored or {}

    def finished(cell: Cell) -> dict[str, Any] | None:
        record = recipe.read_cell(cell.job)
        return stored.get(cell.id) if record is None else record

    if report_only:
        results = [r for cell in recipe.cells if (r := finished(cell)) is not None]
        if not results:
            raise ConfigError(f"{recipe.cell_store or out}: no finished cells of {recipe.title} to report yet")
        out.mkdir(parents=True, exist_ok=True)
        recipe.write_summary(results, total, out)
        return results
    unknown = sorted(set(only or ()) - {cell.id for cell in recipe.cells})
    if unknown:
        raise PositionError(f"{recipe.title} has no cell {', '.join(unknown)}")
    out.mkdir(parents=True, exist_ok=True)
    if recipe.config is not None:
        _check_folder(out, recipe)
        write_text_atomic(out / "config.yaml", yaml.safe_dump(recipe.config, sort_keys=False))
    executor = executor or LocalExecutor()
    order = sorted(range(total), key=lambda i: recipe.cells[i].wave)     # stable: cell order within a wave
    wanted = {i for i in order if only is None or recipe.cells[i].id in only}
    records: dict[int, dict[str, Any]] = {}

    def summary() -> None:
        recipe.write_summary([records[i] for i in order if i in records], total, out)

    with tqdm(total=len(wanted), desc=recipe.unit, disable=not progress, dynamic_ncols=True) as bar:
        for wave in sorted({cell.wave for cell in recipe.cells}):
            todo = []
            for i in (i for i in order if recipe.cells[i].wave == wave):
                if i in wanted and not recipe.skip_finished:
                    todo.append(i)
                elif (record := finished(recipe.cells[i])) is not None:   # finished: read back
                    records[i] = record
                    bar.update(int(i in wanted))
                elif i in wanted:
                    todo.append(i)
            outcomes = executor.map(recipe.run_cell, [recipe.cells[i].job for i in todo],
                                    [recipe.cells[i].label for i in todo], read=recipe.read_cell)
            for i, outcome in zip(todo, outcomes):
                bar.update(1)
                if not isinstance(outcome, NotStarted):
                    records[i] = outcome
                    if on_cell is not None:
                        on_cell(recipe.cells[i].id, outcome)
                    if recipe.summary_each_cell:
                        summary()
    summary()
    if note := budget_note(len(wanted & set(records)), len(wanted), recipe.unit):
        print(note)
    return [records[i] for i in order if i in records]
