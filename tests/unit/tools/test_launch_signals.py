"""The launcher's signal handling (``te_paged.tools.launch._Signals``), in this process."""

from __future__ import annotations

import os
import signal

import pytest

from te_paged.tools.launch import Interrupted, _Signals


@pytest.mark.parametrize("name", ["SIGHUP", "SIGTERM", "SIGINT"])
def test_the_launchers_signal_handlers_hold_then_raise_then_ignore(name) -> None:
    # spawn_ranks' handlers: a signal while the ranks start is held, raised once they are
    # started (arm), and a second one during the clean-up (disarmed) is ignored.
    signum = getattr(signal, name)
    before = signal.getsignal(signum)
    with _Signals() as signals:
        os.kill(os.getpid(), signum)  # while "starting": held
        with pytest.raises(Interrupted, match=f"interrupted by {name}") as caught:
            signals.arm()
        assert caught.value.signum == signum
        signals.disarm()
        os.kill(os.getpid(), signum)  # during the clean-up: ignored
    assert signal.getsignal(signum) == before  # the caller's handlers are back
    with _Signals() as signals:
        signals.arm()
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signum)  # while running: at once
            for _ in range(100):  # the handler runs between bytecodes
                pass
