"""Where a training step's time goes: one step under ``torch.profiler``, ranked by self time.

``posattn bench --profile`` adds this to every row, and the GPU command's ``profile`` stage
stores it for the setups whose targets were missed, so that a ratio such as "t5's layer costs
1.9× SDPA" comes with what the extra time is spent on (the attention kernel itself, building the
bias, its gradient, a fallback to unfused attention...).

The clock is the one that bounds the step: on CUDA the GPU's (each kernel's duration, which
``torch.profiler`` also attributes to the innermost operator that launched it), on CPU the
operators' self CPU time. ``ops`` ranks operators (``aten::_flash_attention_backward``,
``aten::bmm``...), ``kernels`` (CUDA only) the kernels themselves, whose names say which
backend ran (flash, cutlass memory-efficient, Triton from FlexAttention). Shares are of the
step's total on that clock; the rest below the top entries is summed into ``other``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType

from ..errors import PositionError
from .measure import _sync

NAME_CHARS = 96  # CUDA kernel names are long template instantiations: the head says which kernel it is


def _ranked(times: dict[str, tuple[float, int]], total: float, top: int) -> list[dict[str, Any]]:
    """The ``top`` names by time (µs), each as ms, share of ``total`` and calls, then ``other``."""
    ranked = sorted(times.items(), key=lambda kv: -kv[1][0])
    out = [{"name": name[:NAME_CHARS], "ms": us / 1e3, "share": us / total if total else 0.0, "calls": calls}
           for name, (us, calls) in ranked[:top]]
    rest = sum(us for _, (us, _) in ranked[top:])
    if rest:
        out.append({"name": "other", "ms": rest / 1e3, "share": rest / total if total else 0.0,
                    "calls": sum(c for _, (_, c) in ranked[top:])})
    return out


def step_profile(step: Callable[[], None], device: str, top: int = 8) -> dict[str, Any]:
    """Run ``step`` once under ``torch.profiler`` (after the caller has run it at least once, so
    nothing is compiled or allocated for the first time here) and rank where its time went:
    ``{"clock", "total_ms", "ops", "kernels"}`` (``kernels`` empty on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    if top < 1:
        raise PositionError(f"bench profile: the number of entries must be >= 1, got {top}")
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    _sync()
    with profile(activities=activities) as prof:
        step()
        _sync()
    ops: dict[str, tuple[float, int]] = {}
    kernels: dict[str, tuple[float, int]] = {}
    for e in prof.key_averages():
        if e.is_user_annotation:
            continue
        if e.device_type == DeviceType.CPU:
            us = e.self_device_time_total if cuda else e.self_cpu_time_total
            if us > 0:
                ops[e.key] = (us, e.count)
        elif cuda and e.self_device_time_total > 0:
            kernels[e.key] = (e.self_device_time_total, e.count)
    total = sum(us for us, _ in (kernels if cuda else ops).values())
    return {"clock": "cuda kernels" if cuda else "cpu self time", "total_ms": total / 1e3,
            "ops": _ranked(ops, total, top), "kernels": _ranked(kernels, total, top)}


def profile_lines(label: str, prof: dict[str, Any], entries: int = 6) -> list[str]:
    """A row's profile as text: the step's total, then its top operators (and CUDA kernels)."""
    if "error" in prof:
        return [f"{label}: the profiled step failed ({prof['error']})"]
    lines = [f"{label}: one training step, {prof['total_ms']:.2f} ms of {prof['clock']}"]
    for what in ("ops", "kernels"):
        shown = [e for e in prof.get(what, []) if e["name"] != "other"][:entries]
        if shown:
            lines.append(f"  {what}: " + "; ".join(f"{e['name']} {e['share']:.0%} ({e['ms']:.2f} ms, "
                                                   f"{e['calls']}×)" for e in shown))
    return lines


def profiles_text(rows: list[dict[str, Any]]) -> str:
    """The profiles of ``rows`` (those that have one) under one heading; empty if none has."""
    lines = []
    for r in rows:
        if r.get("profile"):
            lines += profile_lines(f"{r['mechanism']} ({r['kind']}, n={r['n']}, batch={r['batch']})", r["profile"])
    return "\n".join(["where a training step's time goes (one profiled step per case):", *lines]) if lines else ""
