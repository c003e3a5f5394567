"""The prepared GPU command (``scripts/gpu_check.sh``): one call, a hard deadline, stages by priority.

GPU time comes in short windows, so one command does everything in order of value and keeps
each result as soon as it exists:

1. ``tests``: the CUDA tests (pytest log), skipped where they passed on the same GPU at the same
   sources and torch (``results/gpu_tests.json``, :func:`sources_key`);
2. ``layer_eager``: first the layer target's mechanisms at n = 4096 against the baseline it
   names, FlashAttention-backed SDPA (:func:`target_runs`); then the one-block layer of every
   registered mechanism against plain SDPA (:mod:`.run`), every (n, batch) of :data:`SHAPES`,
   most useful shape first;
3. ``layer_compiled``: the same with the steps compiled (``torch.compile``), the target
   mechanisms at n = 4096 first, a few mechanisms per run;
4. ``models``: whole models against Hugging Face (:mod:`.models`) at BERT-base size;
5. ``profile``: where the time goes (:mod:`.profile`, one profiled training step) in the setups
   whose GPU targets were missed: the layer at n = 4096 and the whole encoder against BERT;
6. ``ab``: fast-path alternatives to the CUDA default (:data:`AB_RUNS`), each timed against
   the default in the same interleaved rounds (``posattn bench --ab``), so that the default follows
   a measurement;
7. ``throughput``: cells per GPU-hour of the CAT Fig 2 sweep (:mod:`.throughput`): one eager
   worker against several workers per GPU and the compiled step, on its largest and a middle
   shape;
8. ``cat``: the next unfinished cells of the CAT figure recipes (``posattn compare``), in each
   recipe the cells of its costliest unfinished panels first (:func:`gpu_cells`). When every
   recipe is complete in the store, the stages before it get its time (:func:`fill_boxes`).

Each stage is a child process killed at the end of its time box (or of the whole deadline), so
a kill loses at most the run in flight; every measured setup is a results-store record
(:mod:`.store`) written when its run ends, and a setup already in the store is not measured
again, so the next window adds what is missing. After every stage the new and changed files
under ``results/`` are packed into ``$OUT/results.tar.gz`` and ``$OUT/summary.txt`` says which
stages ran, how long each took and what was left for lack of time.

Settings come from the environment (:class:`Settings`); ``GPU_CHECK_TINY=1`` shrinks every size
so the whole command runs on a CPU in a few minutes. A tiny run keeps its store in ``$OUT/results``
(``$POSATTN_RESULTS`` where set), never in the repository's ``results/``; with that store empty its
CAT stage trains the figures' first cells at full size until the deadline (``GPU_CHECK_RECIPES=""``
skips the stage).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import PositionError
from ..experiments.store import hardware, provenance, read_json, today
from ..options import plain
from ..runtime.compile import COMPILE_MODES
from ..runtime.files import check_name, write_bytes_atomic, write_json_atomic, write_text_atomic
from . import attempts
from .cases import Sizes, spec_label
from .models import model_name
from .report import save_json
from .spec import fields_text
from .throughput import EAGER  # GPU_CHECK_CAT_COMPILE's name for no torch.compile, as --compile-modes'

STAGES = ("tests", "layer_eager", "layer_compiled", "models", "profile", "ab", "throughput", "cat")
# the longest each stage may take (seconds), within the whole deadline; "cat" takes what is left
# (and when no CAT cell is left to train, fill_boxes gives that time to the measurement stages)
# (a first window measures; the stages skip what the store holds, so later windows go to the CAT cells)
# (the first windows spent every box, so the CAT stage got 0 to 130 s and no cell: the boxes now
# leave it CAT_SECONDS at least of the default deadline; the tests, which compile FlexAttention
# steps, run 8 at a time where pytest-xdist is installed, as in the GPU machines' image, and took
# their whole 60 s box in the last window; they now hold the flex_tma, flex_autotune and band-gradient
# checks too; the A/B stages, layer arms and whole-model arms (models stage), whose answers decide
# the CUDA defaults and could turn missed targets into met ones, take 20 s each from the eager and
# compiled grids, which are long tails: 95 eager and 192 compiled setups left on the H100)
BOXES = {"tests": 90, "layer_eager": 35, "layer_compiled": 35, "models": 45, "profile": 30, "ab": 40,
         "throughput": 30}
CAT_SECONDS = 160
# the measurement stages' units are small and the time a stage leaves unspent (finished early, skipped,
# nothing to do) goes to the next stage's box: on an H100 (2026-11-27, two windows) a run of five
# mechanisms at n 4096, a compiled run of two, a profile run of three models, an A/B run of three
# mechanisms and a throughput setting each outlasted its 25-55 s box, so those stages were killed
# with nothing stored, window after window, while the models stage finished 43 s early
TEST_WORKERS = 8
# cells a CAT run picks per worker (gpu_cells): a whole 9-minute call holds about 8 of a minute each
CAT_CELLS_PER_WORKER = 10
RESERVE = 15  # seconds kept at the end for the archive and the summary
PUBLISH = 30  # seconds kept after a compare run to copy its finished cells into the store
# (n, batch), most useful first: the n = 4096 targets, then the shapes of the earlier H100 table
SHAPES = [(4096, 16), (512, 16), (128, 16), (512, 64), (128, 64), (4096, 64)]
# the GPU layer target's own baseline, "FlexAttention against FlashAttention-backed SDPA" (the FlexAttention
# paper reports 0.85-0.9x of FlashAttention-2 for such biases), where PyTorch's own choice on the H100 was
# cuDNN's attention (the sdpa row's profile: aten::_cudnn_attention_forward/backward, 2026-11-27): the eager
# stage's first run times the target mechanisms at n = 4096, batch 16 with every SDPA call on FlashAttention
TARGET_SHAPE = (4096, 16)
TARGET_POLICY: dict[str, Any] = {"sdpa_backend": "flash"}
TARGET_GROUP = 2  # mechanisms per target run: the ones the target names first (COMPILE_FIRST); a kill loses one run
# compiled first: the mechanisms the layer targets name, and the ones users train most
COMPILE_FIRST = ["alibi", "t5", "tisa", "fixed_conv", "dynamic_conv", "rope", "absolute", "cat"]
MODEL_MECHANISMS = ["alibi", "t5", "tisa", "fixed_conv", "dynamic_conv", "composite", "cat"]
# the profile stage, most telling first: the layers that missed 1.25× SDPA at n = 4096 (one per run,
# each beside plain SDPA), then the whole encoder against BERT and the score-term encoders that missed
# 1.10× / 1.25× the encoder with absolute (trained with attention dropout: the dense bias path)
PROFILE_LAYER = ["t5", "alibi", "tisa", "dynamic_conv", "fixed_conv", "key_dynamic_conv", "composite", "diet_rel",
                 "cat"]
PROFILE_MODELS = [[], ["t5"], ["dynamic_conv"], ["composite"], ["alibi"], ["tisa"], ["cat"]]  # []: absolute, BERT
PROFILE_TOP = 10
# the models stage after its grid: whole-model A/B runs (models, Policy overrides of the B arm) of the
# arms that could turn a missed whole-model target into a met one, stored in gpu_model_ab: the CAT
# encoder (1.55x the encoder with absolute, the target 1.25x, 2026-11-30, H200: its profile spends
# 24 ms a step more in the convolution's eager elementwise kernels) with the convolution compiled
# (the layer went from 1.62x to 1.42x SDPA on an H100); the encoder against BERT (0.95x, H200) with
# its QKV projection as three products. (The ALiBi encoder under cuDNN's kernel is no longer asked:
# it met its 1.10x at 1.08x, and the layer A/B measured no gain, 1.16x SDPA against 1.14x.)
MODEL_AB_RUNS: list[tuple[list[str], dict[str, Any]]] = [
    ([model_name("posattn_encoder"), model_name("posattn_encoder", ["cat"])], {"compiled_conv": True}),
    ([model_name("posattn_encoder"), "hf_bert"], {"split_qkv": True}),
]
# the ab stage: (n, batch, heads, dropout, mechanisms, fast-path Policy overrides of the B arm). The
# whole encoder trains with attention dropout, which sends score terms to the dense bias; there the
# query/key-relative terms' gather scatter-adds every clipped offset of a row into the window's two
# edge slots in its backward, the skewed construction only sums (fast.Policy.relative_bias): the
# first run keeps the gather, the CUDA default until this stage measured the skew 3.5-4x faster
# (2026-11-27, H100), beside it. At n = 4096 without dropout they take FlexAttention, whose backward
# adds into the captured products per score, the same contention: the second run times the skewed
# dense bias against it
RELATIVE = ["dynamic_conv", "key_dynamic_conv", "composite"]
AB_RUNS: list[tuple[int, int, int, float, list[str], dict[str, Any]]] = [
    # first the arms that could turn a missed target into a met one, then the ones that explain.
    # The encoder's shape: its QKV projection as three products, whose backward stacks no dq, dk, dv
    # (posattn_encoder against BERT, 0.99x, spent 1.75 ms in aten::cat and 1.43 in aten::copy_)
    (512, 32, 12, 0.1, ["absolute"], {"split_qkv": True}),
    # the encoder's shape, with attention dropout: a score term takes the dense bias into SDPA, where
    # PyTorch chose the memory-efficient kernel for biases that learn (cuDNN's returns no bias
    # gradient; 13.2 + 5.9 ms over 12 layers against cuDNN's 3.7 + 1.9 for the T5 encoder). ALiBi's
    # bias learns nothing: does cuDNN's kernel take it, and what does that save (its encoder 1.12x
    # absolute's, the target 1.10x)?
    (512, 32, 12, 0.1, ["alibi"], {"sdpa_backend": "cudnn"}),
    # the layer target against FlashAttention-backed SDPA at n 4096: ALiBi in FlexAttention reads its
    # [h, 2n - 1] table per score (1.33x, forward 1.52 ms of kernel against cuDNN's 0.58, 2026-11-27,
    # H100); the FlexAttention paper computes it (0.85-0.9x FlashAttention-2): is the read the cost?
    (4096, 16, 4, 0.0, ["alibi"], {"flex_formula": True}),
    # FlexAttention's kernels through Hopper's Tensor Memory Accelerator (torch's USE_TMA, off by
    # default): its forward is the same 1.52-1.59 ms whatever the score_mod reads (alibi, t5, tisa,
    # fixed_conv, diet_rel at n 4096, 2026-11-27, H100), so the kernel itself is the cost
    (4096, 16, 4, 0.0, ["alibi", "t5"], {"flex_tma": True}),
    # ... and with the configuration Inductor finds fastest by timing its candidates (last: its
    # compile times every candidate, the longest unit of the stage)
    (4096, 16, 4, 0.0, ["alibi"], {"flex_autotune": True}),
    (512, 32, 12, 0.1, RELATIVE, {"relative_bias": "gather"}),
    (4096, 16, 4, 0.0, RELATIVE, {"use_flex": False, "relative_bias": "skew"}),
    # the short depthwise convolutions compiled: CAT's whole encoder spent 27 of its 79 ms of kernels
    # in some 860 elementwise, copy and sum kernels (2026-11-27, H100), eager's shift-and-add
    (512, 32, 12, 0.1, ["cat", "depthwise_conv", "conv_qkv"], {"compiled_conv": True}),
    # Landmark CAT's picked blocks read by index in compiled kernels: eager launches one matmul per
    # block, b·h·L/B of them a layer, and took 91x SDPA at n 512 (2026-11-27, H100)
    (512, 16, 4, 0.0, ["landmark_cat"], {"compiled_blocks": True}),
]
# Fig 2 first: its cells train in about a minute each on an H100 (bench-throughput: 258 cells/h
# with 4 compiled workers), so a window's last minutes finish some; Fig 1's 2-layer cells at
# lengths up to 4096 finished none in 107 s (2026-11-27) and go on from the CPU (20-30 min a cell)
RECIPES = ["cat_fair_mqar", "cat_fair_ar_length", "cat_fair_mqnar", "cat_fair_landmark"]
TESTS = ["tests/core/test_cuda.py", "tests/pretrain/test_cuda.py"]
# per GPU, the sources at which its CUDA tests last passed (a JSON file beside the recipe folders, like
# the unit ledger): a window whose sources and torch are the same skips the tests stage and gives its box
# to the next stage (the tests took 75-90 s of each 480 s window on 2026-11-30, H200, at one commit)
PASSES = "gpu_tests.json"
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".json", ".yaml", ".toml")
THROUGHPUT_RECIPE = "cat_fair_mqar"  # CAT Fig 2
# (workers, compile mode or None for eager), most telling first: the step is launch-bound, so
# several workers and CUDA graphs ("reduce-overhead") are the candidates; the baseline comes first
THROUGHPUT_SETTINGS: list[tuple[int, str | None]] = [(1, None), (2, None), (4, None), (1, "reduce-overhead"),
                                                     (4, "reduce-overhead"), (8, None)]
ARCHIVE = "results.tar.gz"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


@dataclass
class Settings:
    """What the command does, from the environment (``GPU_CHECK_*``)."""

    out: Path
    device: str = "cuda"
    seconds: float = 480.0
    tiny: bool = False
    shapes: list[tuple[int, int]] = field(default_factory=lambda: list(SHAPES))
    mechanisms: list[str] = field(default_factory=list)  # [] = every registered one
    recipes: list[str] = field(default_factory=lambda: list(RECIPES))
    # the CAT stage's compare: the best setting the throughput stage measured on an H100 (Fig 2's
    # largest cell: 4 workers with CUDA graphs 258 cells/h, 187 with each cell's start-up counted,
    # against 8 eager workers' 173 and 166, 1 eager 72; the compiled loss then still computed
    # every position's logits, since cut to the scored rows)
    workers: int = 4
    cat_compile: str | None = "reduce-overhead"
    repeats: int = 3
    compile_mode: str = "default"
    compile_group: int = 1  # inductor takes tens of seconds per case: small runs, each kept when it ends
    eager_group: int = 4  # mechanisms per eager run (a kill at the box loses one run's worth)
    boxes: dict[str, float] = field(default_factory=lambda: dict(BOXES))
    work: Path = Path("/tmp/gpu_check")  # compare run folders (not in the repository)
    results: Path = Path("results")
    tests: list[str] = field(default_factory=lambda: list(TESTS))
    retest: bool = False  # run the CUDA tests although they passed at these sources on this GPU
    throughput_cells: list[str] = field(default_factory=lambda: ["largest", "middle"])
    throughput_settings: list[tuple[int, str | None]] = field(default_factory=lambda: list(THROUGHPUT_SETTINGS))
    throughput_steps: int = 200
    throughput_warmup: int = 5
    profile_shape: tuple[int, int] = (4096, 16)  # (n, batch) of the layer profiles

    @classmethod
    def from_env(cls, out: str | Path, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        s = cls(out=Path(out))
        get = env.get
        try:
            s.device = get("GPU_CHECK_DEVICE", s.device)
            s.seconds = float(get("GPU_CHECK_SECONDS", s.seconds))
            s.tiny = get("GPU_CHECK_TINY", "0") not in ("", "0")
            if s.tiny:
                s.shapes = [(32, 2), (64, 2)]
                s.throughput_cells, s.throughput_settings = ["smallest"], [(1, None), (2, None)]
                s.throughput_steps, s.throughput_warmup = 3, 1
                s.profile_shape = (64, 2)
            if "GPU_CHECK_SHAPES" in env:  # "4096x16 512x16"
                s.shapes = [tuple(_ints(p.replace("x", " "))) for p in env["GPU_CHECK_SHAPES"].split()]  # type: ignore[misc]
            s.mechanisms = get("GPU_CHECK_MECHANISMS", "").replace(",", " ").split()
            if "GPU_CHECK_RECIPES" in env:
                s.recipes = env["GPU_CHECK_RECIPES"].replace(",", " ").split()
            s.workers = int(get("GPU_CHECK_WORKERS", s.workers))
            cat_compile = get("GPU_CHECK_CAT_COMPILE", EAGER if s.tiny else s.cat_compile)
            if cat_compile not in (None, "", EAGER, *COMPILE_MODES):
                raise ValueError(f"GPU_CHECK_CAT_COMPILE must be {EAGER} or one of {', '.join(COMPILE_MODES)}")
            s.cat_compile = None if cat_compile in (None, "", EAGER) else cat_compile
            s.repeats = int(get("GPU_CHECK_REPEATS", 1 if s.tiny else s.repeats))
            s.compile_mode = get("GPU_CHECK_COMPILE_MODE", "dynamo" if s.tiny else s.compile_mode)
            s.compile_group = int(get("GPU_CHECK_COMPILE_GROUP", s.compile_group))
            s.eager_group = int(get("GPU_CHECK_EAGER_GROUP", s.eager_group))
            for item in get("GPU_CHECK_BOXES", "").replace(",", " ").split():  # "tests=60 models=90"
                name, _, value = item.partition("=")
                if name not in BOXES:
                    raise ValueError(f"GPU_CHECK_BOXES: unknown stage {name!r} (stages: {', '.join(BOXES)})")
                s.boxes[name] = float(value)
            s.work = Path(get("GPU_CHECK_WORK", s.work))
            # a tiny run is a smoke test: its numbers never belong in the repository's store
            s.results = Path(get("POSATTN_RESULTS", s.out / "results" if s.tiny else s.results))
            if "GPU_CHECK_TESTS" in env:
                s.tests = env["GPU_CHECK_TESTS"].split()
            s.retest = get("GPU_CHECK_RETEST", "0") not in ("", "0")
        except ValueError as e:
            raise PositionError(f"gpu check: bad setting ({e})") from None
        if s.seconds <= RESERVE or s.workers < 1 or s.repeats < 1 or min(s.compile_group, s.eager_group) < 1:
            raise PositionError(f"gpu check: GPU_CHECK_SECONDS must exceed {RESERVE} and the workers, repeats "
                                f"and groups must be >= 1")
        if any(len(shape) != 2 or min(shape) < 1 for shape in s.shapes):
            raise PositionError(f"gpu check: GPU_CHECK_SHAPES must be NxBATCH pairs, got {s.shapes}")
        return s


def pytest_command(tests: list[str]) -> list[str]:
    """The tests stage's command: ``tests`` in :data:`TEST_WORKERS` processes where pytest-xdist
    is installed (each FlexAttention case compiles its kernels, seconds of CPU per test: one
    process ran 12 of the CUDA tests in its 60 s box on the first H100 window)."""
    import importlib.util

    spread = ["-n", str(min(TEST_WORKERS, os.cpu_count() or 1))] if importlib.util.find_spec("xdist") else []
    # the project's addopts already say -q: one more would drop the "N passed, M failed" line from pytest.log
    return [sys.executable, "-m", "pytest", *tests, "-p", "no:cacheprovider", *spread]


def sources_key(tests: list[str], root: Path | None = None) -> str:
    """What the CUDA tests test, as one hash: torch's version, the test files named, and every
    source file (:data:`SOURCE_SUFFIXES`) under ``posattn/`` and ``tests/`` of ``root`` (the
    repository), by path and content."""
    import torch

    root = Path(__file__).resolve().parents[2] if root is None else root
    h = hashlib.sha256(f"torch {torch.__version__}\ntests {' '.join(tests)}\n".encode())
    for top in ("posattn", "tests"):
        for path in sorted((root / top).rglob("*")):
            if path.is_file() and path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts:
                h.update(f"{path.relative_to(root)}\n".encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def passes(root: Path) -> dict[str, dict[str, str]]:
    """Per GPU (its name), the sources at which its CUDA tests last passed ({} when none)."""
    path = root / PASSES
    data = read_json(path) if path.exists() else {}
    if not (isinstance(data, dict) and all(isinstance(v, dict) and "sources" in v for v in data.values())):
        raise PositionError(f"{path}: not a record of CUDA test passes ({{\"<GPU>\": {{\"sources\": ...}}}})")
    return data


def record_pass(root: Path, hw: str, key: str) -> None:
    """Keep that the CUDA tests passed on ``hw`` at the sources ``key`` (the entry it had is replaced)."""
    data = passes(root)
    data[hw] = {"sources": key, "date": today()}
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(root / PASSES, dict(sorted(data.items())))


# -- the measurements (run in child processes) ---------------------------------------------------
def layer_plan(mechanisms: list[str], shapes: list[tuple[int, int]], group: int | None,
               first: list[str] = COMPILE_FIRST) -> list[tuple[int, int, list[str]]]:
    """The runs of a layer stage: per shape (in order), the mechanisms (``first`` ones first) in
    groups of ``group`` (None: all in one run)."""
    ordered = [m for m in first if m in mechanisms] + [m for m in mechanisms if m not in first]
    size = group or max(1, len(ordered))
    return [(n, b, ordered[i:i + size]) for n, b in shapes for i in range(0, len(ordered), size)]


def _append_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    old = json.loads(path.read_text()) if path.exists() else []
    save_json(old + rows, path)


def _log(msg: str) -> None:
    print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)


def mode_name(mode: str) -> str:
    """The ``mode`` of a layer record: ``eager`` or ``compile <torch.compile mode>``."""
    return mode if mode == "eager" else f"compile {mode}"


def target_runs(s: Settings, names: list[str]) -> list[tuple[int, int, list[str], dict[str, Any]]]:
    """The eager stage's first runs: the mechanisms of the GPU layer target at :data:`TARGET_SHAPE`
    under :data:`TARGET_POLICY` (n, batch, mechanisms, Policy overrides); none unless that shape is
    one of ``s.shapes`` (tiny: the first of them), in runs of :data:`TARGET_GROUP`."""
    from .report import LAYER_TARGETS

    shape = s.shapes[0] if s.tiny else TARGET_SHAPE
    mechs = [m for m in names if m in LAYER_TARGETS]
    if shape not in s.shapes or not mechs:
        return []
    return [(n, b, group, TARGET_POLICY) for n, b, group in layer_plan(mechs, [shape], TARGET_GROUP)]


def layer_todo(s: Settings, mode: str, hw: str | None = None) -> list[tuple[Sizes, list[str], dict[str, Any]]]:
    """The layer runs of ``mode`` ("eager" or a compile mode) still to do on the hardware ``hw``
    (default: this machine's ``s.device``): (sizes with n as ``max_len`` and the batch, the
    mechanisms whose record is missing, the run's Policy overrides): eager first the
    :func:`target_runs`, then the grid in the order of :func:`layer_plan`."""
    from .. import mechanisms as registry
    from .store import LAYER_RECIPE, missing, setup

    names = s.mechanisms or registry.names()
    sizes = layer_sizes(s)
    hw = hw or hardware(s.device)
    runs = target_runs(s, names) if mode == "eager" else []
    runs += [(n, batch, group, {}) for n, batch, group in
             layer_plan(names, s.shapes, s.eager_group if mode == "eager" else s.compile_group)]
    out = []
    for n, batch, group, policy in runs:
        run_sizes = replace(sizes, batch=batch, max_len=n)
        todo = [m for m in group if missing(LAYER_RECIPE, [setup("layer", spec_label([m]), n, batch, run_sizes,
                                                                 mode_name(mode), hw, policy)], s.results)]
        if todo:
            out.append((run_sizes, todo, policy))
    return out


def _failed_rows(rows: list[dict[str, Any]], attempt: attempts.Attempt) -> None:
    """A unit with a row that failed (not stored) stays in the ledger: the next window runs it
    after the units that never failed, instead of first again."""
    if any(r.get("error") for r in rows):
        attempt.fail()


def layer_unit(mode: str, sizes: Sizes, mechs: list[str], policy: dict[str, Any]) -> str:
    """A layer run's name in the log and in the ledger of unfinished units (:mod:`.attempts`)."""
    return (f"layer {mode_name(mode)} n={sizes.max_len} batch={sizes.batch} {' '.join(mechs)}"
            + (f" {fields_text(policy)}" if policy else ""))


def layer_stage(s: Settings, mode: str, rows_out: Path) -> None:
    """Measure every layer setup of ``mode`` ("eager" or a compile mode) not yet in the store."""
    import torch

    from .run import BenchOptions, run
    from .store import LAYER_RECIPE, publish_rows

    compiled = mode != "eager"
    for (sizes, todo, policy), attempt in attempts.in_turn("layer_compiled" if compiled else "layer_eager",
                                                           layer_todo(s, mode), lambda u: layer_unit(mode, *u),
                                                           s.results):
        overrides = fields_text(policy)
        where = layer_unit(mode, sizes, todo, policy)
        _log(where)
        opts = BenchOptions(mechanisms=[[m] for m in todo], lengths=[sizes.max_len], kinds=("layer",), sizes=sizes,
                            batches=[sizes.batch], threads=min(16, torch.get_num_threads()), repeats=s.repeats,
                            warmup=1 if compiled else 0,  # eager: building the case ran each step once
                            memory=not (compiled or s.tiny), compile=mode if compiled else None,
                            policy=dict(policy))
        rows = run(opts, log=_log)
        command = (f"posattn bench --kinds layer --device {s.device} --dtype {sizes.dtype} -n {sizes.max_len} "
                   f"--batch {sizes.batch} --repeats {s.repeats} -m {' '.join(todo)}"
                   + (f" --compile {mode}" if compiled else "") + (f" --policy {overrides}" if policy else ""))
        written, kept = publish_rows(LAYER_RECIPE, "layer", rows, sizes, mode_name(mode),
                                     provenance(command, s.device), s.results)
        _append_rows(rows_out, [{**r, "mode": mode_name(mode)} for r in rows])
        _failed_rows(rows, attempt)
        _log(f"{where}: {written} records written, {kept} already there, "
             f"{sum(1 for r in rows if r.get('error'))} errors")


def model_groups(mechanisms: list[str]) -> list[tuple[list[str], list[str]]]:
    """The model runs: (the models timed together, the ones whose records the run is for). Each
    run holds its reference: the encoder (``absolute``) and its MLM variant against BERT, the
    decoder (``rope``) against Llama, then score-term encoders three at a time beside ``absolute``.
    Names as :func:`.models.model_name` gives them."""
    enc = model_name("posattn_encoder")
    groups = [([enc, "posattn_mlm", "hf_bert"],) * 2, (["posattn_decoder", "hf_llama"],) * 2]
    for i in range(0, len(mechanisms), 3):
        subjects = [model_name("posattn_encoder", [m]) for m in mechanisms[i:i + 3]]
        groups.append(([enc, *subjects], subjects))
    return groups


def model_sizes(s: Settings) -> Sizes:
    """BERT-base (12 layers, d 768, 12 heads, FFN 3072, n 512, batch 32) in bf16; tiny: 2 small layers."""
    if s.tiny:
        sizes = Sizes(heads=2, head_dim=16, vocab=512, layers=2, d_ff=64, batch=2, max_len=32, dtype="float32")
    else:
        sizes = Sizes(heads=12, head_dim=64, vocab=30522, layers=12, d_ff=3072, batch=32, max_len=512,
                      dtype="bfloat16")
    return replace(sizes, dropout=0.1, device=s.device)


def model_todo(s: Settings, hw: str | None = None) -> list[list[str]]:
    """The model runs whose records are not all in the store yet (on ``hw``, by default this
    machine's accelerator)."""
    from .cases import CaseSpec
    from .models import DEFAULT_MECHANISMS
    from .store import MODEL_RECIPE, missing, setup

    sizes, hw = model_sizes(s), hw or hardware(s.device)
    n = sizes.max_len
    references = {m for ms in DEFAULT_MECHANISMS.values() for m in ms}  # measured in the reference runs
    mechs = [m for m in (s.mechanisms or MODEL_MECHANISMS) if m not in references]
    return [group for group, subjects in model_groups(mechs)
            if missing(MODEL_RECIPE, [setup("model", CaseSpec("model", name, n).label, n, sizes.batch, sizes,
                                            "eager", hw) for name in subjects], s.results)]


def model_ab_todo(s: Settings, hw: str | None = None) -> list[tuple[list[str], dict[str, Any]]]:
    """The runs of :data:`MODEL_AB_RUNS` with a setup (either arm) not in ``gpu_model_ab`` yet
    (only those whose mechanisms are all in ``GPU_CHECK_MECHANISMS`` when that is set)."""
    from .cases import CaseSpec
    from .models import HF_MODELS
    from .store import MODEL_AB_RECIPE, missing, setup

    sizes, hw = model_sizes(s), hw or hardware(s.device)
    n = sizes.max_len
    out = []
    for group, ab in MODEL_AB_RUNS:
        named = [m for g in group if g.startswith("[") for m in json.loads(g)[1]]
        if s.mechanisms and not set(named) <= set(s.mechanisms):
            continue
        specs = [CaseSpec("model", g, n) for g in group]
        specs += [CaseSpec("model", g, n, json.dumps(ab)) for g in group if g not in HF_MODELS]
        if missing(MODEL_AB_RECIPE, [setup("model", c.label, n, sizes.batch, sizes, "eager", hw) for c in specs],
                   s.results):
            out.append((group, ab))
    return out


def model_stage(s: Settings, rows_out: Path) -> None:
    """Whole models against Hugging Face, every run not yet in the store, then the whole-model
    A/B runs (:data:`MODEL_AB_RUNS`, both arms in the same interleaved rounds)."""
    import torch

    from .cases import CaseSpec
    from .models import model_rows
    from .run import BenchOptions, run
    from .store import MODEL_AB_RECIPE, MODEL_RECIPE, publish_rows

    sizes = model_sizes(s)
    n = sizes.max_len
    units = [(group, {}) for group in model_todo(s)] + model_ab_todo(s)

    def name(unit: tuple[list[str], dict[str, Any]]) -> str:
        return f"n={n} batch={sizes.batch}: {', '.join(unit[0])}" + (f" --ab {fields_text(unit[1])}" if unit[1] else "")

    for (group, ab), attempt in attempts.in_turn("models", units, name, s.results):
        _log(f"models n={n} batch={sizes.batch}: {', '.join(CaseSpec('model', g, n).label for g in group)}"
             + (f" against --ab {fields_text(ab)}" if ab else ""))
        opts = BenchOptions(kinds=("model",), models=group, lengths=[n], batches=[sizes.batch], sizes=sizes,
                            threads=min(16, torch.get_num_threads()), repeats=s.repeats, warmup=1,
                            memory=not s.tiny, ab=dict(ab))
        rows = model_rows(run(opts, log=_log))
        ref = next((r for r in rows if r["mechanism"] == "posattn_encoder" and r.get("train_ms")), None)
        for r in rows:
            if ref and r["mechanism"].startswith("posattn_encoder") and r.get("train_ms"):
                r["vs_posattn_encoder"] = r["train_ms"] / ref["train_ms"]  # step time ÷ absolute's, same run
        command = (f"posattn bench --models --device {s.device} --dtype {sizes.dtype} -n {n} --batch {sizes.batch} "
                   f"--repeats {s.repeats} ({', '.join(group)})" + (f" --ab {fields_text(ab)}" if ab else ""))
        written, kept = publish_rows(MODEL_AB_RECIPE if ab else MODEL_RECIPE, "model", rows, sizes, "eager",
                                     provenance(command, s.device), s.results)
        _append_rows(rows_out, rows)
        _failed_rows(rows, attempt)
        _log(f"models: {written} records written, {kept} already there")


def throughput_stage(s: Settings, rows_out: Path) -> None:
    """Cells per hour of the CAT Fig 2 sweep by setting (:func:`.throughput.bench`); a cell whose
    settings are all in the store is skipped, each row is stored when measured."""
    from .throughput import Setting, bench

    def key(setting: Setting) -> str:
        return f"throughput: {setting.workers} worker(s), {setting.mode}"

    # the baseline runs first in any case (every ratio is to it, same run); the others in ledger order
    wanted = attempts.in_order([Setting(w, c) for w, c in s.throughput_settings], key, s.results)
    errors: list[str] = []
    rows = bench(THROUGHPUT_RECIPE, s.throughput_cells, wanted, s.throughput_steps, s.throughput_warmup, s.device,
                 root=s.results, skip_stored=True, log=_log, errors=errors,
                 attempt=lambda setting: attempts.running(key(setting), s.results))   # a failed one stays
    _append_rows(rows_out, rows)
    _log(f"throughput: {len(rows)} settings measured, {len(errors)} failed")


def throughput_left(s: Settings) -> str:
    """The settings of the throughput stage's cells that have no record yet."""
    from ..synthetic.compare import load_config, validate_config
    from .throughput import Setting, missing, pick_cells

    cells = pick_cells(validate_config(load_config(THROUGHPUT_RECIPE)), s.throughput_cells)
    wanted = [Setting(w, c) for w, c in s.throughput_settings]
    left = sum(len(missing(THROUGHPUT_RECIPE, cell, wanted, s.throughput_steps, s.throughput_warmup, 1,
                           hardware(s.device), s.results)) for cell in cells)
    return f"{left} settings left" if left else "every setting in the store"


def layer_sizes(s: Settings) -> Sizes:
    """The layer stages' sizes: the earlier H100 table's (4 heads of 64) in bf16; tiny: 2 heads
    of 16 in fp32 (CPUs lack fast bf16). ``max_len`` and ``batch`` are set per run."""
    return replace(Sizes(heads=2, head_dim=16) if s.tiny else Sizes(), device=s.device,
                   dtype="float32" if s.tiny else "bfloat16")


def profile_todo(s: Settings) -> list[tuple[str, Sizes, list[str]]]:
    """The profile runs whose setups are not all in the store: (bench kind, sizes, case names),
    one layer run (one mechanism of :data:`PROFILE_LAYER`; plain SDPA is in every run) then two
    model runs (:data:`PROFILE_MODELS`), and so on. Only registered mechanisms, or those
    of ``GPU_CHECK_MECHANISMS`` when set."""
    from .. import mechanisms as registry
    from .cases import CaseSpec
    from .store import PROFILE_RECIPE, missing, setup

    hw = hardware(s.device)
    keep = set(s.mechanisms or registry.names())
    n, batch = s.profile_shape
    sizes = replace(layer_sizes(s), batch=batch, max_len=n)
    mechs = [m for m in PROFILE_LAYER if m in keep]
    layer = [("layer", sizes, [m]) for m in mechs]
    msizes = model_sizes(s)
    models = [("model", msizes, [model_name("posattn_encoder", [m]) for m in group if m in keep] if group
               else [model_name("posattn_encoder"), "hf_bert"]) for group in PROFILE_MODELS]
    models = [run for run in models if run[2]]
    # alternate, so that a short window profiles some of each: layer, model, model, layer, ...
    runs: list[tuple[str, Sizes, list[str]]] = []
    while layer or models:
        runs += layer[:1] + models[:2]
        layer, models = layer[1:], models[2:]

    def label(bench: str, name: str, at: Sizes) -> str:
        return spec_label([name]) if bench == "layer" else CaseSpec("model", name, at.max_len).label

    return [(bench, at, names) for bench, at, names in runs
            if missing(PROFILE_RECIPE, [setup(bench, label(bench, name, at), at.max_len, at.batch, at, "eager", hw)
                                        for name in names], s.results)]


def profile_stage(s: Settings) -> None:
    """One profiled training step (and one timed round) per setup of :func:`profile_todo`, each
    run's rows stored in ``gpu_profile`` when it ends."""
    import torch

    from .run import BenchOptions, run
    from .store import PROFILE_RECIPE, publish_recipe, publish_rows

    for (bench, sizes, names), attempt in attempts.in_turn("profile", profile_todo(s),
                                                           lambda u: f"{u[0]} n={u[1].max_len} batch={u[1].batch}: "
                                                                     f"{', '.join(u[2])}", s.results):
        n = sizes.max_len
        where = f"profile {bench} n={n} batch={sizes.batch}"
        _log(f"{where}: {', '.join(names)}")
        common = dict(lengths=[n], batches=[sizes.batch], sizes=sizes, threads=min(16, torch.get_num_threads()),
                      repeats=1, warmup=0, memory=False, profile=PROFILE_TOP)
        if bench == "layer":
            opts = BenchOptions(mechanisms=[[m] for m in names], kinds=("layer",), **common)  # type: ignore[arg-type]
            command = f"posattn bench --kinds layer -m {' '.join(names)}"
        else:
            opts = BenchOptions(kinds=("model",), models=names, **common)  # type: ignore[arg-type]
            command = f"posattn bench --models ({', '.join(names)})"
        rows = run(opts, log=_log)
        command += (f" --device {s.device} --dtype {sizes.dtype} -n {n} --batch {sizes.batch} --repeats 1 "
                    f"--warmup 0 --profile {PROFILE_TOP}")
        prov = provenance(command, s.device)
        for r in rows:  # a step the profiler could not record is no record: the next window tries again
            if "error" in r.get("profile", {}):
                r.setdefault("error", f"profile: {r['profile']['error']}")
                _log(f"{where}: {r['mechanism']}: {r['error']}")
        if any(r.get("profile") and "error" not in r for r in rows):
            publish_recipe(PROFILE_RECIPE, "profile", prov, s.results)
        written, kept = publish_rows(PROFILE_RECIPE, bench, rows, sizes, "eager", prov, s.results)
        _failed_rows(rows, attempt)
        _log(f"{where}: {written} records written, {kept} already there")


def ab_todo(s: Settings) -> list[tuple[Sizes, list[str], dict[str, Any]]]:
    """The runs of :data:`AB_RUNS`, one per mechanism, whose setups (both arms) are not all in the
    store: (sizes, [mechanism], overrides); tiny: n 32, batch 2 and the tiny heads."""
    from .cases import CaseSpec
    from .store import AB_RECIPE, missing, setup

    hw = hardware(s.device)
    out = []
    for n, batch, heads, dropout, mechs, ab in AB_RUNS:
        sizes = replace(layer_sizes(s), max_len=n, batch=batch, heads=heads, dropout=dropout)
        if s.tiny:
            sizes = replace(sizes, max_len=32, batch=2, heads=layer_sizes(s).heads)
        for m in mechs:
            if s.mechanisms and m not in s.mechanisms:
                continue
            labels = [CaseSpec("layer", json.dumps([m]), sizes.max_len, arm).label for arm in ("", json.dumps(ab))]
            if missing(AB_RECIPE, [setup("layer", label, sizes.max_len, sizes.batch, sizes, "eager", hw)
                                   for label in labels], s.results):
                out.append((sizes, [m], ab))
    return out


def ab_stage(s: Settings, rows_out: Path) -> None:
    """Each run of :func:`ab_todo`: the mechanisms under the default fast path and under the
    overrides, in the same interleaved rounds beside plain SDPA, stored as layer records of
    ``gpu_layer_ab`` (both arms of a run together)."""
    import torch

    from .run import BenchOptions, run
    from .store import AB_RECIPE, publish_rows

    def name(unit: tuple[Sizes, list[str], dict[str, Any]]) -> str:
        sizes, mechs, ab = unit
        return (f"n={sizes.max_len} batch={sizes.batch} heads={sizes.heads} dropout={sizes.dropout}: "
                f"{', '.join(mechs)} against --ab {fields_text(ab)}")

    for (sizes, mechs, ab), attempt in attempts.in_turn("ab", ab_todo(s), name, s.results):
        n = sizes.max_len
        overrides = fields_text(ab)
        where = f"ab n={n} batch={sizes.batch} heads={sizes.heads} dropout={sizes.dropout}"
        _log(f"ab {name((sizes, mechs, ab))}")
        opts = BenchOptions(mechanisms=[[m] for m in mechs], lengths=[n], kinds=("layer",), sizes=sizes,
                            batches=[sizes.batch], threads=min(16, torch.get_num_threads()), repeats=s.repeats,
                            warmup=1, memory=False, ab=dict(ab))
        rows = run(opts, log=_log)
        command = (f"posattn bench --kinds layer --device {s.device} --dtype {sizes.dtype} -n {n} "
                   f"--batch {sizes.batch} --heads {sizes.heads} --dropout {sizes.dropout} --repeats {s.repeats} "
                   f"--no-memory -m {' '.join(mechs)} --ab {overrides}")
        written, kept = publish_rows(AB_RECIPE, "layer", rows, sizes, "eager", provenance(command, s.device),
                                     s.results)
        _append_rows(rows_out, rows)
        _failed_rows(rows, attempt)
        _log(f"{where}: {written} records written, {kept} already there")


# -- the CAT figure cells -------------------------------------------------------------------------
def stored(recipe: str, root: Path) -> tuple[str, set[str], list[Any]]:
    """(the sweep's name, the ids of its cells in the store, its cells); one error if the store
    holds another config under the sweep's name."""
    from ..experiments.publish import stored_cells
    from ..synthetic.compare import load_config, validate_config

    sweep = validate_config(load_config(recipe))
    name = check_name(sweep.name, "sweep name")
    ids = {cell.id for cell in sweep.cells}
    return name, ids & set(stored_cells(name, "compare", sweep.config, f"sweep {name!r}", root)), sweep.cells


def gpu_cells(cells: list[Any], present: set[str], at_least: int) -> list[str]:
    """The ids of the ``cells`` (a sweep's, :func:`stored`) not in ``present`` that a GPU trains
    first: those of the costliest panels (a panel is one width and training length; cost
    d_model × length), the costliest first, until at least ``at_least`` are picked (fewer when
    fewer are left). On a GPU these small models' steps are launch-bound (on the H100 one eager
    worker trained Fig 2's largest cell, d 128 at n 256, at 120 steps/s: 50 s for its 6000
    steps), so a small cell costs it about as much as a large one, while a CPU's time grows with
    the cell (a Fig 2 cell of d 32 at n 64 takes 1.5–3 minutes on one core, of d 64 about 3):
    the GPU takes the cells a CPU cannot afford and leaves it the small ones."""
    panels: dict[tuple[int, int], list[str]] = {}
    for cell in cells:
        if cell.id not in present:
            panels.setdefault((cell.d_model * cell.train_length, cell.train_length), []).append(cell.id)
    picked: list[str] = []
    for panel in sorted(panels, reverse=True):
        if len(picked) >= at_least:
            break
        picked += panels[panel]
    return picked


def cat_pending(s: Settings) -> bool:
    """Whether a CAT recipe of ``s.recipes`` has a cell the store lacks (a recipe the checkout
    cannot load gives the CAT stage nothing to train: its note says why)."""
    for recipe in s.recipes:
        try:
            _, present, cells = stored(recipe, s.results)
        except Exception:
            continue
        if len(present) < len(cells):
            return True
    return False


def fill_boxes(s: Settings) -> float:
    """With no CAT cell left to train, the time the CAT stage would have taken (the deadline less
    the boxes and :data:`RESERVE`) goes to the measurement stages: each nonzero box but the tests'
    grows by the same factor, returned (1.0: the boxes are left as they are)."""
    grow = [name for name, box in s.boxes.items() if name != "tests" and box > 0]
    free = s.seconds - RESERVE - sum(s.boxes.values())
    if not grow or free <= 0 or cat_pending(s):
        return 1.0
    factor = 1.0 + free / sum(s.boxes[name] for name in grow)
    for name in grow:
        s.boxes[name] *= factor
    return factor


# -- the driver -----------------------------------------------------------------------------------
@dataclass
class StageResult:
    name: str
    status: str  # "done", "stopped at its time box", "failed (exit N)", "skipped: ..."
    seconds: float = 0.0
    note: str = ""


class Driver:
    """Runs the stages in order within the deadline and keeps $OUT up to date after each."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.start = time.monotonic()
        self.results: list[StageResult] = []
        self.spare = 0.0  # seconds the stages so far left of their boxes: the next stage may use them
        self.grown = 1.0  # the factor fill_boxes gave the boxes
        self.log = (s.out / "gpu_check.log").open("a")
        self.before = self._snapshot()

    def left(self) -> float:
        return self.s.seconds - RESERVE - (time.monotonic() - self.start)

    def _snapshot(self) -> dict[str, str]:
        root = self.s.results
        if not root.is_dir():
            return {}
        return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*")) if p.is_file()}

    def child(self, argv: list[str], limit: float, log: Any = None) -> tuple[int | None, float]:
        """Run ``argv`` for at most ``limit`` seconds (its whole process group killed after);
        returns (exit status or None if killed, seconds)."""
        t0 = time.monotonic()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")])),
               "POSATTN_RESULTS": str(self.s.results)}   # the store every stage reads and writes
        proc = subprocess.Popen(argv, stdout=log or self.log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
        return rc, time.monotonic() - t0

    def stage(self, name: str, argv: list[str], log: Any = None, left: Callable[[], str] | None = None,
              done: Callable[[], None] | None = None) -> None:
        """Run one stage within its box and the time earlier stages left of theirs (a stage without
        a box of its own gets none); ``left`` says what it left undone (for the summary), ``done``
        runs when the stage finished before its box, so that what it records is in this pack."""
        own = self.s.boxes.get(name, 0.0)
        box = min(own + self.spare, self.left())
        if own <= 0:
            self.results.append(StageResult(name, "skipped: its box is 0 s"))
        elif box < 5:
            self.results.append(StageResult(name, "skipped: no time left"))
        else:
            self.log.write(f"\n===== {name} (at most {box:.0f} s) =====\n")
            self.log.flush()
            rc, seconds = self.child(argv, box, log)
            status = "done" if rc == 0 else "stopped at its time box" if rc is None else f"failed (exit {rc})"
            self.results.append(StageResult(name, status, seconds))
            self.spare = 0.0 if rc is None else max(0.0, box - seconds)
        if done and self.results[-1].status == "done":
            done()
        notes = [left()] if left else []
        stuck = [key for key in attempts.load(self.s.results) if key.startswith(f"{name}: ")]
        if stuck:
            notes.append(f"{len(stuck)} unit(s) unfinished in some window, run after the others")
        self.results[-1].note = "; ".join(notes)
        self.finish()

    def layer_left(self, mode: str) -> str:
        todo = layer_todo(self.s, mode)
        if not todo:
            return "every setup in the store"
        sizes, mechs, policy = todo[0]
        return (f"{sum(len(t) for _, t, _ in todo)} setups left, next: n={sizes.max_len} batch={sizes.batch} "
                f"{', '.join(mechs)}" + (f" {fields_text(policy)}" if policy else ""))

    def tests(self) -> None:
        """The CUDA tests, unless they passed on this GPU at these sources (:func:`sources_key`):
        then their box goes to the next stage. A pass is recorded in the store."""
        s = self.s
        hw, key = hardware(s.device), sources_key(s.tests)
        before = passes(s.results).get(hw, {})
        if before.get("sources") == key and not s.retest:
            self.results.append(StageResult("tests", "skipped: passed before", 0.0,
                                            f"passed at these sources and torch on {before.get('date')}, "
                                            f"{hw} (GPU_CHECK_RETEST=1 runs them)"))
            self.spare += s.boxes.get("tests", 0.0)
            self.finish()
            return
        with (s.out / "pytest.log").open("w") as log:
            self.stage("tests", pytest_command(s.tests), log, done=lambda: record_pass(s.results, hw, key))

    def me(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "posattn.cli", "gpu-check", "--out", str(self.s.out), *args]

    def run(self) -> None:
        s = self.s
        self.grown = fill_boxes(s)
        self.tests()
        self.stage("layer_eager", self.me("--stage", "layer_eager"), left=lambda: self.layer_left("eager"))
        self.stage("layer_compiled", self.me("--stage", "layer_compiled"),
                   left=lambda: self.layer_left(s.compile_mode))
        self.stage("models", self.me("--stage", "models"),
                   left=lambda: (f"{len(model_todo(s)) + len(model_ab_todo(s))} model runs left"
                                 if model_todo(s) or model_ab_todo(s) else "every run in the store"))
        self.stage("profile", self.me("--stage", "profile"), left=lambda: (
            f"{len(profile_todo(s))} profile runs left" if profile_todo(s) else "every setup in the store"))
        self.stage("ab", self.me("--stage", "ab"),
                   left=lambda: f"{len(ab_todo(s))} A/B runs left" if ab_todo(s) else "every setup in the store")
        self.stage("throughput", self.me("--stage", "throughput"), left=lambda: throughput_left(s))
        self.cat()

    def cat(self) -> None:
        """The CAT recipes in order, each from its next unfinished cell, until the deadline."""
        from ..experiments.store import hardware, load

        s = self.s
        t0 = time.monotonic()
        notes = []
        for recipe in s.recipes:
            left = self.left()
            if left < PUBLISH + 70:  # under a minute of training is not worth a compare start-up
                notes.append(f"{recipe}: not started (no time left)")
                continue
            run = s.work / f"compare-{Path(recipe).stem}"
            try:  # e.g. a config the checkout cannot load here: said in the summary, the next recipe runs
                name, present, cells = stored(recipe, s.results)
                had, total = len(present), len(cells)
            except Exception as e:
                notes.append(f"{recipe}: not started ({type(e).__name__}: {e})")
                continue
            if had == total:
                notes.append(f"{name}: complete in the store ({total} cells)")
                continue
            # --store: the store's cells count as finished, each cell finished here is added at once
            command = ["compare", recipe, "--store", "--device", s.device, "--workers", str(s.workers)]
            command += ["--compile", s.cat_compile] if s.cat_compile else []
            command += ["--only", *gpu_cells(cells, present, CAT_CELLS_PER_WORKER * s.workers)]
            argv = [sys.executable, "-m", "posattn.cli", *command, "--no-progress", "--out", str(run)]
            # no new cell after the time limit; the kill below is the backstop for the cells in flight
            argv += ["--time-limit", str(int(left - PUBLISH - 60))]
            self.log.write(f"\n===== cat: {name} ({had}/{total} cells in the store, {left:.0f} s left) =====\n")
            self.log.flush()
            rc, _ = self.child(argv, left - PUBLISH)
            if rc != 0:  # killed or failed: cells finished but not yet handed on (workers end out of order)
                add = [sys.executable, "-m", "posattn.cli", "results", "add", str(run), "--command",
                       shlex.join(["posattn", *command]), "--hardware", hardware(s.device)]
                self.child(add, max(5.0, self.left() + RESERVE - 5))
            now = len(load(name, s.results, kind="cell"))
            notes.append(f"{name}: {now - had} new cells, {now}/{total} in the store"
                         + ("" if rc == 0 else " (stopped at the deadline)" if rc is None else f" (exit {rc})"))
            self.finish(extra=StageResult("cat", "running", time.monotonic() - t0, "; ".join(notes)))
        ran = any("not started" not in note for note in notes)
        self.results.append(StageResult("cat", "done" if ran else "skipped", time.monotonic() - t0,
                                        "; ".join(notes) or "no recipes"))
        self.finish()

    def finish(self, extra: StageResult | None = None) -> None:
        """Pack the new and changed store files and write the summary (after every stage)."""
        self.log.flush()
        now = self._snapshot()
        changed = [p for p, h in now.items() if self.before.get(p) != h]
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for rel in changed:
                tar.add(self.s.results / rel, arcname=str(Path("results") / rel))
        write_bytes_atomic(self.s.out / ARCHIVE, buf.getvalue())
        lines = [f"gpu check: {time.monotonic() - self.start:.0f} s of {self.s.seconds:.0f}, device {self.s.device}",
                 f"{len(changed)} new or changed files under {self.s.results}/ in {ARCHIVE}"]
        if self.grown > 1.0:
            lines.append(f"no CAT cell left to train: the measurement stages' boxes grew {self.grown:.2f}x "
                         f"to fill the deadline")
        lines.append("")
        shown = self.results + ([extra] if extra else [])
        for r in shown:
            lines.append(f"{r.name:15s} {r.status:28s} {r.seconds:6.0f} s  {r.note}".rstrip())
        lines += [f"{name:15s} not reached" for name in STAGES if name not in {r.name for r in shown}]
        write_text_atomic(self.s.out / "summary.txt", "\n".join(lines) + "\n")


def command(args: argparse.Namespace) -> None:
    """``posattn gpu-check``: the whole command, or one measuring stage (the driver's children)."""
    if not args.out.is_dir():
        raise PositionError(f"gpu check: --out {args.out} is not a folder")
    s = Settings.from_env(args.out)
    if args.stage == "layer_eager":
        layer_stage(s, "eager", s.out / "layer_bench.json")
    elif args.stage == "layer_compiled":
        layer_stage(s, s.compile_mode, s.out / "layer_bench_compiled.json")
    elif args.stage == "models":
        model_stage(s, s.out / "model_bench.json")
    elif args.stage == "profile":
        profile_stage(s)
    elif args.stage == "ab":
        ab_stage(s, s.out / "layer_bench.json")
    elif args.stage == "throughput":
        throughput_stage(s, s.out / "throughput.json")
    else:
        Driver(s).run()


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``posattn gpu-check`` (what ``scripts/gpu_check.sh`` runs)."""
    p = sub.add_parser("gpu-check", help="the prepared GPU command: CUDA tests, benchmarks and CAT cells into "
                       "the results store within one deadline", description=plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for the archive, logs and summary ($OUT)")
    p.add_argument("--stage", choices=["layer_eager", "layer_compiled", "models", "profile", "ab", "throughput"],
                   help="run one measuring stage in this process (the driver's children)")
    p.set_defaults(func=command, writes={
        "OUT/summary.txt": "the stages run, their times and what was left",
        "OUT/results.tar.gz": "the new and changed files of the results store",
        "OUT/layer_bench*.json, OUT/model_bench.json": "the measured rows of each stage",
        "results/<recipe>/<id>.json": "one store record per measured setup or finished cell"})
