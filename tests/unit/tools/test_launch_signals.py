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


class _Left(Exception):
    pass


@pytest.mark.parametrize(("env", "left"), [({"RANK": "1", "WORLD_SIZE": "4"}, True), ({}, False)])
def test_a_torchrun_rank_leaves_without_the_interpreters_teardown(monkeypatch, env, left) -> None:
    """Under torchrun a rank's process ends through ``launch.leave`` (gloo's native threads can
    abort it in the interpreter's teardown, failing a complete run); any other, by sys.exit."""
    from te_paged import cli
    from te_paged.tools import launch

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(cli, "main", lambda: 1)

    def leave(status):
        raise _Left(status)

    monkeypatch.setattr(launch, "leave", leave)
    try:
        cli.entry()
    except _Left as e:
        how = ("leave", e.args[0])
    except SystemExit as e:
        how = ("sys.exit", e.code)
    want = ("leave", 1) if left else ("sys.exit", 1)
    assert how == want, f"the process ended by {how[0]}({how[1]}), not {want[0]}({want[1]})"
