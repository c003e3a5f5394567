"""One error type for everything posattn refuses: bad input, bad configuration, bad combination
(:class:`PositionError`, exit status 2 on the command line, also when a worker process finds it);
and one for work that failed while running (:class:`RunError`, exit status 1), such as a sweep cell
that failed in a worker process."""
import sys
import traceback

WORKER_TRACEBACK = "\nWorker traceback:\n"


class PositionError(ValueError):
    """Raised with a message that names the mechanism (or option) and the reason."""


class RunError(RuntimeError):
    """The work itself failed (every case of a benchmark, a cell in a worker): the message says what
    failed and why."""


class CellError(RunError):
    """A sweep cell failed in a worker process: the message carries the cell and the worker's
    traceback as text, so it crosses the process boundary even when the original exception
    (e.g. a compiler error that holds a module) cannot be pickled."""

    def summary(self) -> str:
        """The error in one line, without the worker's traceback or a Slurm task's error text: what
        failed and why (or where its log is); a first line that announces the error ('...:') takes
        the error's first line along."""
        lines = [line.strip() for line in str(self).partition(WORKER_TRACEBACK)[0].splitlines() if line.strip()]
        if len(lines) > 1 and lines[0].endswith(":"):
            return f"{lines[0]} {lines[1]}"
        return lines[0] if lines else ""


class CellInputError(CellError, PositionError):
    """A sweep cell refused its input in a worker process (a truncated or foreign checkpoint, a file
    of the wrong kind): a :class:`PositionError` like any other bad input (exit status 2 on the
    command line, no advice to rerun), carrying the worker's traceback as a CellError does."""


def cell_failure(what: str) -> CellError:
    """Call inside ``except``: a :class:`CellError` naming ``what`` and the exception, with the
    current traceback after :data:`WORKER_TRACEBACK` (``posattn --debug`` prints it); a
    :class:`CellInputError` when the exception is a :class:`PositionError`, so that bad input
    found in a worker ends the command as it would in the command's own process."""
    error = sys.exc_info()[1]
    if isinstance(error, PositionError):
        return CellInputError(f"{what}: {str(error).strip()}{WORKER_TRACEBACK}{traceback.format_exc()}")
    reason = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
    return CellError(f"{what} failed ({reason.rstrip(': ')}); rerun the command to resume (finished cells are "
                     f"kept){WORKER_TRACEBACK}{traceback.format_exc()}")
