"""The CLI shows te_paged's warnings as its own lines, between the progress lines."""

from __future__ import annotations

import io
import logging

from te_paged.tools.progress import Progress

RUNNER = logging.getLogger("te_paged.runtime.runner")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_warnings_are_command_lines_between_progress_lines_until_close() -> None:
    before = list(logging.getLogger("te_paged").handlers)
    piped = io.StringIO()
    with Progress(2, "te-paged ab (2 ranks, cpu)", file=piped, logs="te-paged ab") as progress:
        progress("OFF step 1/1")
        RUNNER.warning("PagedStashRunner: step %d reruns", 1)
        RUNNER.info("not shown: below WARNING")
        progress("ON  step 1/1")
    RUNNER.warning("after close: not this command's any more")
    lines = piped.getvalue().splitlines()
    assert lines[2] == "te-paged ab: warning: PagedStashRunner: step 1 reruns"
    assert len(lines) == 4 and lines[3].endswith(", ON  step 1/1]"), lines
    assert logging.getLogger("te_paged").handlers == before  # close() detached it


def test_on_a_terminal_the_warning_is_written_above_the_bar() -> None:
    terminal = _Terminal()
    with Progress(2, "te-paged ab", file=terminal, logs="te-paged ab") as progress:
        progress("OFF step 1/1")
        RUNNER.warning("PagedStashRunner: step 1 reruns")
        progress("ON  step 1/1")
    drawn = terminal.getvalue()
    assert "te-paged ab: warning: PagedStashRunner: step 1 reruns\n" in drawn
    assert drawn.endswith("\n") and "2/2" in drawn.split("reruns\n")[1]  # the bar, redrawn


def test_without_logs_nothing_is_attached() -> None:
    before = list(logging.getLogger("te_paged").handlers)
    with Progress(1, "te-paged bench: stash", file=io.StringIO()):
        assert logging.getLogger("te_paged").handlers == before
