"""The background lane of rank launches (functional_tests/prelaunch.py): planned in test order,
from what each selected test reads (its ``launch`` marks, or its module's ``LAUNCHES``).

The functional tests are collected first (``testpaths``) and run after the in-process ones
(:func:`pytest_collection_modifyitems`): in a whole run the lane starts once they are collected,
while the rest of the suite is still being collected (about 20 s of one core; before, the lane
waited for the end of collection).
"""

from __future__ import annotations

import pytest

from functional_tests import launch, prelaunch

_LANE: prelaunch.Lane | None = None


def _early(config: pytest.Config) -> bool:
    """Whether launches may start during collection: only where nothing deselects tests after
    collection (``-k``, ``-m``, ``--deselect``, ``--lf``, ``--sw``), whose launches would run
    for nothing."""
    option = config.option
    return not (
        option.collectonly
        or option.keyword
        or option.markexpr
        or getattr(option, "deselect", None)
        or getattr(option, "lf", False)
        or getattr(option, "stepwise", False)
    )


def _lane(config: pytest.Config) -> prelaunch.Lane:
    global _LANE
    if _LANE is None:
        _LANE = prelaunch.Lane(prelaunch.folders(config._tmp_path_factory))
    return _LANE


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """In-process tests first, then the functional tests (which read the lane's launches), then
    those that ask for ``quiet_machine``, each in collection order. The quiet fixture waits for
    every queued launch: anywhere earlier, the tests after it would run with the lane idle and
    one core spare (measured: the last 57 s of the suite)."""
    items.sort(key=lambda item: ("quiet_machine" in getattr(item, "fixturenames", ()),
                                 _functional(item)))  # fmt: skip


def _functional(item: pytest.Item) -> bool:
    return "functional_tests" in item.path.parts


_COLLECTED: list[pytest.Item] = []  # functional tests collected, not yet planned


class _Planner:
    """Plans the lane when collection leaves functional_tests/: every functional test is
    collected then. Not earlier: the Megatron workers of one release are one launch whose parts
    come from several modules. A plugin of its own, registered for the whole session: this
    conftest's own hooks see only the nodes under functional_tests/."""

    @staticmethod
    def pytest_collectstart(collector: pytest.Collector) -> None:
        if _COLLECTED and "functional_tests" not in collector.path.parts:
            _lane(collector.config).plan(launch for item in _COLLECTED for launch in _needs(item))
            _COLLECTED.clear()


def planned_early(config: pytest.Config) -> bool:
    """Whether the lane was planned before collection ended (by :class:`_Planner`)."""
    return config.pluginmanager.is_registered(_Planner) and not _COLLECTED


def pytest_itemcollected(item: pytest.Item) -> None:
    if _functional(item) and _early(item.config) and _needs(item):
        _COLLECTED.append(item)
        if not item.config.pluginmanager.is_registered(_Planner):
            item.config.pluginmanager.register(_Planner, "te_paged_prelaunch_planner")


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    lane = _lane(session.config)
    needed = [launch for item in session.items for launch in _needs(item)]
    lane.retain(launch.group for launch in needed)
    lane.plan(needed)  # those planned already stay where they are


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
