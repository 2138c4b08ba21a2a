"""Progress of a ``te-paged`` command on stderr.

On a terminal a ``tqdm`` bar, redrawn in place. Anywhere else (a pipe, a file, a CI log) a
``\\r``-redrawn bar would be one unreadable line at the end, so each step prints one line of its
own, as soon as it finishes::

    te-paged ab (4 ranks, cpu) 0/6 [00:00<?, started]
    te-paged ab (4 ranks, cpu) 1/6 [00:09<00:45, OFF step 1/3]
    ...

With ``logs="te-paged ab"`` the library's warnings (the ``te_paged`` logger: a runner's
fallback) are shown the way the command shows its own messages, between the progress lines
(above the bar on a terminal, which is then redrawn)::

    te-paged ab: warning: PagedStashRunner: step 1 reruns dropless without the paged stash ...
"""

from __future__ import annotations

import logging
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

    ``file`` defaults to ``sys.stderr``; a bar is drawn only when it is a terminal. ``logs``
    (the command, e.g. ``"te-paged ab"``) shows te_paged's WARNING log records until
    ``close()``, as ``<logs>: warning: <message>``.
    """

    def __init__(
        self, total: int, desc: str, *, file: TextIO | None = None, logs: str | None = None
    ) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
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
        self._handler = None
        if logs is not None:
            self._handler = _LogLines(self, logs)
            logging.getLogger("te_paged").addHandler(self._handler)

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

    def write(self, line: str) -> None:
        """A line of its own: above the bar on a terminal (the bar is redrawn below it)."""
        if self._bar is not None:
            self._tqdm.write(line, file=self.file)
        else:
            print(line, file=self.file, flush=True)

    def close(self) -> None:
        if self._handler is not None:
            logging.getLogger("te_paged").removeHandler(self._handler)
            self._handler = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _LogLines(logging.Handler):
    """te_paged's WARNING records as the command's own lines (``prog: warning: message``)."""

    def __init__(self, progress: Progress, prog: str) -> None:
        super().__init__(logging.WARNING)
        self.progress, self.prog = progress, prog

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.progress.write(f"{self.prog}: {record.levelname.lower()}: {record.getMessage()}")
        except Exception:
            self.handleError(record)
