"""The command-line options that several ``posattn`` commands share, defined once so that they mean
the same everywhere: ``--device``, ``--json``, ``--threads``, counts that must be positive, and the
checks the command line runs before a command starts (the device is there, the output folder is
usable), so that a bad value ends in one ``posattn: error:`` line before anything is written.

Argument *types* (:func:`positive_int`, :func:`device`, ...) refuse a bad value while the command
line is parsed; :func:`check_device` and :func:`check_output_folder` look at the machine, once, in
:func:`posattn.cli.main`.
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

import torch

from .errors import PositionError

DEVICE_HELP = "auto (CUDA when available, else CPU; the default), cpu, cuda or cuda:N"
JSON_HELP = "print the JSON report to stdout instead of the text summary (the files are written as always)"
DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")


def plain(doc: str) -> str:
    """A docstring as ``--help`` text: reST's ``literal`` and :role:`target` become `literal` and target."""
    return re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc.replace("``", "`"))


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type): counts, sizes, lengths."""
    return _int_at_least(text, 1)


def sequence_length(text: str) -> int:
    """A sequence length: an integer >= 2 (argparse type)."""
    return _int_at_least(text, 2)


def natural_int(text: str) -> int:
    """An integer >= 0 (argparse type): caps where 0 means "no cap", untimed rounds."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (argparse type): learning rates, epochs, factors."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (argparse type); whether it is there is
    :func:`check_device`'s question, asked once the command line is parsed."""
    if not DEVICE_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use auto, cpu, cuda or cuda:N")
    return text


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--device auto|cpu|cuda|cuda:N`` (default auto), the same in every command that computes."""
    parser.add_argument("--device", type=device, default="auto", metavar="DEVICE", help=DEVICE_HELP)


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """``--json``: print the command's JSON to stdout (every command that has one)."""
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def add_compile_option(parser: argparse.ArgumentParser) -> None:
    """``--compile [MODE]``: how a training command computes its steps, never what (not part of a
    run's identity, so it may change when a run resumes)."""
    from posattn.runtime.compile import COMPILE_MODES

    parser.add_argument("--compile", nargs="?", const="default", choices=COMPILE_MODES, metavar="MODE",
                        help="run each training step's forward and backward through torch.compile (MODE: "
                             f"{', '.join(COMPILE_MODES)}; default 'default'; 'reduce-overhead' adds CUDA graphs; "
                             "'dynamo' captures graphs without code generation); evaluation stays eager")


def add_log_to_option(parser: argparse.ArgumentParser) -> None:
    """``--log-to DEST``: mirrors of a run's metrics.jsonl (:mod:`posattn.runtime.metrics`)."""
    from posattn.runtime.metrics import MIRRORS

    parser.add_argument("--log-to", nargs="+", default=[], choices=MIRRORS, metavar="DEST",
                        help=f"also send every metrics row to DEST ({', '.join(MIRRORS)}: scalars in "
                             "<run folder>/tensorboard; needs pip install 'posattn[tensorboard]'); "
                             "metrics.jsonl stays the record")


def add_threads_option(parser: argparse.ArgumentParser, what: str = "worker") -> None:
    """``--threads N`` (default 1): torch CPU threads per ``what``."""
    parser.add_argument("--threads", type=positive_int, default=1,
                        help=f"torch CPU threads per {what} (default 1: tiny models run fastest single-threaded, "
                             f"and spinning OpenMP threads stall a busy machine)")


def check_device(name: str, remote: bool = False) -> None:
    """PositionError unless ``name`` (a value of ``--device``) is usable on this machine. ``remote``:
    the work runs elsewhere (``--executor slurm``), so only the spelling was checked."""
    if remote or name in ("auto", "cpu"):
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(name.partition(":")[2] or 0)
    if index >= count:
        seen = f"{count} CUDA device(s)" if count else "no CUDA device"
        raise PositionError(f"--device {name} is not available: torch sees {seen}; use --device cpu or auto")


def check_output_folder(folder: str | Path, option: str = "--out") -> None:
    """PositionError unless ``folder`` is (or can be created as) a folder this process may write in;
    nothing is created here."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise PositionError(f"{option} {folder}: exists and is not a folder")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise PositionError(f"{option} {folder}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        which = "" if probe == path else f" ({probe} is not writable)"
        raise PositionError(f"{option} {folder}: permission denied{which}; choose a folder you may write in")


def check_args(args: Any) -> None:
    """The checks every parsed command line gets before its command runs: its device, its output folder
    (and the results store's folder)."""
    if getattr(args, "device", None) is not None:
        check_device(args.device, remote=getattr(args, "executor", None) == "slurm")
    for option in ("out", "results"):
        if isinstance(folder := getattr(args, option, None), (str, Path)):
            check_output_folder(folder, f"--{option}")
