"""Progress of a ``te-paged`` command on stderr.

On a terminal a ``tqdm`` bar, redrawn in place. Anywhere else (a pipe, a file, a CI log) a
``\\r``-redrawn bar would be one unreadable line at the end, so each step prints one line of its
own, as soon as it finishes::

    te-paged ab (4 ranks, cpu) 0/6 [00:00<?, started]
    te-paged ab (4 ranks, cpu) 1/6 [00:09<00:45, OFF step 1/3]
    ...
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

__all__ = ["Progress"]

# One line per step: the step count, elapsed<remaining, then what finished.
_LINE = "{desc} {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"


def _columns(file: TextIO) -> int:
    try:
        return os.get_terminal_size(file.fileno()).columns
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both of the first
        return 0


class Progress:
    """``progress(message)`` after each of ``total`` steps; ``close()`` (or ``with``) at the end.

    ``file`` defaults to ``sys.stderr``; a bar is drawn only when it is a terminal.
    """

    def __init__(self, total: int, desc: str, *, file: TextIO | None = None) -> None:
        from tqdm import tqdm

        self.total, self.desc, self.n = total, desc, 0
        self.file = sys.stderr if file is None else file
        self._format = tqdm.format_meter
        self._start = time.monotonic()
        isatty = getattr(self.file, "isatty", None)
        self._bar = None
        if isatty is not None and isatty():
            # A terminal that reports no size (a pty without one: `script`, `docker -t`) would
            # get a bar of 0 columns on 0 rows, i.e. nothing: give it 100 x 20.
            sized = _columns(self.file) > 0
            self._bar = tqdm(
                total=total, desc=desc, file=self.file, unit="step", dynamic_ncols=sized,
                ncols=None if sized else 100, nrows=None if sized else 20,
            )  # fmt: skip
        else:
            self._line("started")

    def __call__(self, message: str) -> None:
        """One step finished; ``message`` says which (``"OFF step 1/3"``)."""
        self.n += 1
        if self._bar is not None:
            self._bar.set_postfix_str(message, refresh=False)
            self._bar.update(1)
        else:
            self._line(message)

    def _line(self, message: str) -> None:
        elapsed = time.monotonic() - self._start
        line = self._format(
            self.n, self.total, elapsed, prefix=self.desc, postfix=message or None,
            bar_format=_LINE, unit="step",
        )  # fmt: skip
        print(line, file=self.file, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
