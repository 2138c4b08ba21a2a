"""One gloo transport device for all of a process's gloo groups.

torch gives each gloo group a device of its own, and each device a loop thread that wakes every
10 ms while the group lives. megatron-core makes about 130 groups a rank on four CPU ranks (its
parallel groups, each also as a gloo copy): idle, those loops take about 15 % of a core a rank,
and the suite's launches share two cores. gloo multiplexes any number of groups on one device;
the launchers here (``functional_tests/forkrun.py``) give every group the process's one.
"""

from __future__ import annotations

import datetime


def share_one_device() -> None:
    """From now on, each gloo group this process makes uses the process's one transport device
    (made by the first group: after any fork). Idempotent."""
    from torch.distributed import distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "shares_one_device", False):
        return
    devices: list = []

    class OneDeviceGloo(base):  # type: ignore[misc, valid-type]
        shares_one_device = True

        def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30), **flags):
            if isinstance(timeout, base._Options):  # options given: as torch's own callers do
                super().__init__(store, rank, size, timeout)
                return
            if not devices:
                devices.append(base.create_default_device())
            options = base._Options()
            options._devices = devices
            options._timeout = timeout
            for name, value in flags.items():  # torch 2.15's enable_reconfigure, say
                setattr(options, name, value)  # one these options lack: AttributeError
            super().__init__(store, rank, size, options)

    OneDeviceGloo.__name__ = OneDeviceGloo.__qualname__ = base.__name__
    c10d.ProcessGroupGloo = OneDeviceGloo
