"""The benchmark driver: build the cases per length, time them interleaved, measure memory."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import mechanisms
from ..attention import fast, native
from ..mechanisms.conv import METHODS, conv_method
from ..runtime.compile import check_mode
from ..runtime.compile import compiled as compiled_fn
from . import peers as peer_lib
from .cases import BASELINE, Case, CaseSpec, Sizes, make_case, spec_label
from .measure import measure_memory, median, time_cases
from .models import HF_MODELS
from .profile import step_profile

KINDS = ("layer", "op")  # "model" (whole models against Hugging Face) runs on its own: --models


@dataclass
class BenchOptions:
    """Everything ``posattn bench`` can be asked for."""

    mechanisms: list[list[Any]] = field(default_factory=lambda: [[m] for m in mechanisms.names()])
    lengths: list[int] = field(default_factory=lambda: [256, 1024, 4096])
    kinds: tuple[str, ...] = KINDS
    sizes: Sizes = field(default_factory=Sizes)
    batches: list[int] = field(default_factory=lambda: [1])  # a grid: every length × batch
    models: list[str] = field(default_factory=list)  # model cases (kind "model", :mod:`.models`)
    policy: dict[str, Any] = field(default_factory=dict)  # fast-path Policy fields to override
    ab: dict[str, Any] = field(default_factory=dict)  # every mechanism timed again under these overrides
    threads: int = 2
    repeats: int = 5
    warmup: int = 1
    timing: bool = True
    memory: bool = True
    peers: bool = False
    compile: str | None = None  # a COMPILE_MODES entry: every case's steps through torch.compile
    profile: int = 0  # > 0: after timing, one profiled training step per case, its top entries (:mod:`.profile`)


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def case_specs(opts: BenchOptions, n: int) -> list[CaseSpec]:
    """Baselines first, then every mechanism per kind, then the peers (or the model cases)."""
    if opts.kinds == ("model",):  # the B arm: posattn's models again under the overrides (not Hugging Face's)
        return ([CaseSpec("model", name, n) for name in opts.models]
                + [CaseSpec("model", name, n, json.dumps(opts.ab)) for name in opts.models
                   if opts.ab and name not in HF_MODELS])
    specs: list[CaseSpec] = []
    for kind in opts.kinds:
        specs.append(CaseSpec(kind, BASELINE, n))
        specs += [CaseSpec(kind, json.dumps(m), n) for m in opts.mechanisms]
        if opts.ab and kind in ("layer", "op"):  # the B arm, in the same interleaved rounds
            specs += [CaseSpec(kind, json.dumps(m), n, json.dumps(opts.ab)) for m in opts.mechanisms]
    if opts.peers:
        specs += [CaseSpec("peer", p, n) for p in peer_lib.available()]
    return specs


def compiled(case: Case, mode: str) -> Case:
    """``case`` with its training step and inference pass compiled by ``torch.compile``
    (:func:`posattn.runtime.compile.compiled`), each run once so that compilation happens here
    and not in the timing."""
    check_mode(mode, "bench --compile")
    train, infer = compiled_fn(case.train, mode), compiled_fn(case.infer, mode)
    train()
    infer()
    return Case(case.spec, train, infer, f"{case.path} [compiled {mode}]")


def _build(specs: list[CaseSpec], sizes: Sizes, errors: dict[CaseSpec, str],
           compile_mode: str | None = None) -> list[Case]:
    cases = []
    for spec in specs:
        try:
            case = make_case(spec, sizes)
            if case is not None and compile_mode:
                case = compiled(case, compile_mode)
        except Exception as e:  # a mechanism that cannot run at this size is reported, not fatal
            errors[spec] = f"{type(e).__name__}: {e}"
            continue
        if case is not None:
            cases.append(case)
    return cases


def run(opts: BenchOptions, log: Callable[[str], None] = _log,
        partial: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Measure every case; one row (dict) per mechanism, kind, length and batch. ``partial``
    gets the rows so far after each (length, batch) (long runs keep what they measured)."""
    torch.set_num_threads(opts.threads)
    if opts.peers:
        for peer, ours in peer_lib.MATCH.items():
            if peer in peer_lib.available() and ours not in opts.mechanisms:
                opts.mechanisms.append(ours)
    rows: list[dict[str, Any]] = []
    policy = fast.policy_for(torch.device(opts.sizes.device), **opts.policy)
    for n, batch in [(n, b) for b in opts.batches for n in opts.lengths]:
        sizes = Sizes(**{**opts.sizes.__dict__, "max_len": max(opts.lengths),
                         "batch": batch})
        with fast.using(policy):
            rows += _measure(n, sizes, opts, log)
        if partial:
            partial(rows)
    return rows


def _measure(n: int, sizes: Sizes, opts: BenchOptions, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The rows of one length and batch: build, time interleaved, then peak memory."""
    where = f"n={n} batch={sizes.batch}"
    specs = case_specs(opts, n)
    errors: dict[CaseSpec, str] = {}
    times: dict[CaseSpec, dict[str, list[float]]] = {}
    paths: dict[CaseSpec, str] = {}
    profiles: dict[CaseSpec, dict[str, Any]] = {}
    applicable = specs
    if opts.timing:
        log(f"{where}: building {len(specs)} cases")
        cases = _build(specs, sizes, errors, opts.compile)
        paths = {c.spec: c.path for c in cases}
        applicable = [c.spec for c in cases]
        log(f"{where}: timing {len(cases)} cases × {opts.repeats} rounds")
        times = time_cases(cases, opts.repeats, opts.warmup, lambda m: log(f"{where}: {m}")) if cases else {}
        if opts.profile:
            log(f"{where}: profiling one training step of {len(cases)} cases")
            profiles = _profiles(cases, sizes.device, opts.profile)
        del cases
    memory: dict[CaseSpec, dict[str, Any]] = {}
    if opts.memory and not opts.compile:  # the memory child rebuilds eager cases: compiled runs have none
        log(f"{where}: peak memory of {len(applicable)} cases (child process)")
        memory = measure_memory(applicable, sizes, opts.threads, policy=opts.policy)
    return _rows(n, sizes, specs, times, memory, paths, errors, opts, profiles)


def _profiles(cases: list[Case], device: str, top: int) -> dict[CaseSpec, dict[str, Any]]:
    """One profiled training step per case (:func:`.profile.step_profile`); a case whose step
    fails under the profiler keeps its times, its profile is the error."""
    out: dict[CaseSpec, dict[str, Any]] = {}
    for case in cases:
        try:
            out[case.spec] = step_profile(case.train, device, top)
        except Exception as e:  # noqa: BLE001 - reported in the row, the other cases go on
            out[case.spec] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _rows(n: int, sizes: Sizes, specs: list[CaseSpec], times: dict[CaseSpec, dict[str, list[float]]],
          memory: dict[CaseSpec, dict[str, Any]], paths: dict[CaseSpec, str],
          errors: dict[CaseSpec, str], opts: BenchOptions,
          profiles: dict[CaseSpec, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per case; ratios against the same kind's plain-SDPA baseline (model cases have
    none: :func:`.models.model_rows` compares them with Hugging Face instead)."""
    rows = []
    base = {kind: CaseSpec(kind, BASELINE, n) for kind in opts.kinds}
    base["peer"] = base.get("layer", CaseSpec("layer", BASELINE, n))
    for spec in specs:
        if spec not in times and spec not in memory and spec not in errors:
            continue
        ref = base.get(spec.kind)
        row: dict[str, Any] = {"mechanism": spec.label, "kind": spec.kind, "n": n,
                               "path": paths.get(spec, ""), "threads": opts.threads,
                               **{k: v for k, v in sizes.__dict__.items() if k != "max_len"}}
        if opts.policy:  # the fast-path Policy fields the whole run was under (a setup of its own)
            row["policy"] = dict(opts.policy)
        for what in ("train", "infer"):
            t, b = times.get(spec, {}).get(what), times.get(ref, {}).get(what) if ref else None
            row[f"{what}_ms"] = median(t) * 1e3 if t else None
            row[f"{what}_ratio"] = median(t) / median(b) if t and b else None
            row[f"{what}_runs_ms"] = [x * 1e3 for x in t] if t else []
            if t and b:  # ratio of the least disturbed runs (a loaded machine only adds time)
                row[f"{what}_ratio_min"] = min(t) / min(b)
            if t and b and len(t) == len(b):  # per round: the spread of the ratio, and its median
                per_round = sorted(x / y for x, y in zip(t, b))
                row[f"{what}_ratio_range"] = [per_round[0], per_round[-1]]
                row[f"{what}_ratio_rounds"] = median(per_round)  # each round's pair ran close in time
        mem, base_mem = memory.get(spec, {}), memory.get(ref, {}) if ref else {}
        row["peak_mem_mb"] = mem.get("train_mb")
        row["infer_peak_mem_mb"] = mem.get("infer_mb")
        row["mem_ratio"] = (mem["train_mb"] / base_mem["train_mb"]
                            if mem.get("train_mb") is not None and base_mem.get("train_mb") else None)
        if profiles and spec in profiles:
            row["profile"] = profiles[spec]
        err = errors.get(spec) or mem.get("error")
        if err:
            row["error"] = err
        rows.append(row)
    return rows


def peer_matches() -> dict[str, str]:
    return {peer: spec_label(ours) for peer, ours in peer_lib.MATCH.items()}


COMPILED_CONV_UP_TO = 33  # the longest kernel `bench --conv` times the compiled shift-and-add at


def conv_rows(kernels: list[int], n: int, channels: int, batch: int, threads: int,
              repeats: int, compiled_up_to: int = COMPILED_CONV_UP_TO) -> list[dict[str, Any]]:
    """Training-step time of each depthwise-convolution algorithm per kernel length; the
    compiled shift-and-add only for kernels up to ``compiled_up_to``: its graph unrolls one
    shifted product per tap and compiles once per length (on one loaded CPU core, cold cache:
    3.6 s at k 5, 15 s at 33, 23 s at 65, 98 s at 257), while ``conv_method`` chooses it only up
    to ``SHIFT_MAX`` taps."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, n, channels, generator=g).requires_grad_()
    rows = []
    for k in kernels:
        w = torch.randn(channels, k, generator=g).requires_grad_()
        cases = {}
        for name, fn in METHODS.items():
            if name == "native" and native.kernels() is None:
                continue  # the C++ kernels did not build here
            if name == "compiled" and k > compiled_up_to:
                continue
            def step(fn: Callable[..., torch.Tensor] = fn, w: torch.Tensor = w, k: int = k) -> None:
                x.grad = w.grad = None
                fn(x, w, k - 1).pow(2).mean().backward()
            cases[name] = step
        runs = time_cases([Case(CaseSpec("conv", name, k), step, lambda: None)
                           for name, step in cases.items()], repeats, 1)
        row: dict[str, Any] = {"kernel": k, "chosen": conv_method(k, x)}
        for spec, t in runs.items():
            row[f"{spec.name}_ms"] = median(t["train"]) * 1e3
        rows.append(row)
    return rows
