"""The background lane of rank launches (functional_tests/prelaunch.py): planned when
collection ends, in test order, from what each selected test reads (its ``launch`` marks, or
its module's ``LAUNCHES``)."""

from __future__ import annotations

import pytest

from functional_tests import launch, prelaunch

_LANE: prelaunch.Lane | None = None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that ask for ``quiet_machine`` run last, in their order. The fixture waits for
    every queued launch: anywhere earlier, the tests after it would run with the lane idle and
    one core spare (measured: the last 57 s of the suite)."""
    items.sort(key=lambda item: "quiet_machine" in getattr(item, "fixturenames", ()))


def pytest_collection_finish(session: pytest.Session) -> None:
    global _LANE
    if session.config.option.collectonly:
        return
    _LANE = prelaunch.Lane(prelaunch.folders(session.config._tmp_path_factory))
    _LANE.plan(launch for item in session.items for launch in _needs(item))


def _needs(item: pytest.Item) -> list[prelaunch.Launch]:
    """The launches ``item`` reads: its ``@pytest.mark.launch(LAUNCH)`` marks, or else its
    module's ``LAUNCHES`` (read by a module fixture)."""
    marked = [mark.args[0] for mark in item.iter_markers("launch")]
    return marked or list(getattr(getattr(item, "module", None), "LAUNCHES", ()))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _LANE is not None:
        _LANE.stop()
    launch.end_all()


@pytest.fixture(scope="session")
def launches() -> prelaunch.Lane:
    """The lane: ``launches.result(LAUNCH)`` is that launch's result."""
    if _LANE is None:  # collection ran without this plugin's hook (should not happen)
        pytest.fail("the prelaunch lane was not planned")
    return _LANE


@pytest.fixture
def quiet_machine(launches: prelaunch.Lane) -> None:
    """No background launch runs during this test: for a test that times its own ranks."""
    launches.drain()
