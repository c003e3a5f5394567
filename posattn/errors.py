"""One error type for everything posattn refuses: bad input, bad configuration, bad combination;
and one for a sweep cell that failed in a worker process."""
import traceback


class PositionError(ValueError):
    """Raised with a message that names the mechanism (or option) and the reason."""


class CellError(RuntimeError):
    """A sweep cell failed in a worker process: the message carries the cell and the worker's
    traceback as text, so it crosses the process boundary even when the original exception
    (e.g. a compiler error that holds a module) cannot be pickled."""


def cell_failure(what: str) -> CellError:
    """Call inside ``except``: a :class:`CellError` naming ``what`` with the current traceback."""
    return CellError(f"{what} failed; rerun the command to resume (finished cells are kept). "
                     f"Worker traceback:\n{traceback.format_exc()}")
