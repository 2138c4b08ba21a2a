"""Where :class:`~te_paged.integrations.megatron.MegatronLoopAdapter` reads the training loop's
logging settings: the interval, the iteration about to be logged, the TensorBoard writer.

Two loops build Megatron's ``PagedStashRunner`` around te_paged's layers, and keep those
settings in different places:

==============================  ===================================  ===========================
loop                            settings                             found
==============================  ===================================  ===========================
Megatron-LM's ``pretrain()``    ``megatron.training``'s global       ``get_args()``,
                                arguments (``log_interval``,         ``get_tensorboard_writer()``
                                ``curr_iteration``)
Megatron-Bridge's ``pretrain``  the run's ``GlobalState``            the frame that builds
/ ``finetune()``                (``cfg.logger.log_interval``,        Megatron's runner (Bridge's
                                ``train_state.step``,                ``train()``/``evaluate()``)
                                ``tensorboard_logger``)              holds it
==============================  ===================================  ===========================

Bridge has no global accessor for its state and nothing of Bridge is patched outside CPU runs,
so :func:`find_bridge_state` looks for the ``GlobalState`` among the locals of the frames that
call into the adapter while Megatron's runner is built (once per ``train()`` and per
evaluation, not per step). Importing this module imports neither library.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

__all__ = ["LogSettings", "find_bridge_state", "log_settings"]

#: (interval, the iteration about to be logged, TensorBoard writer or None).
LogSettings = tuple["int | None", "int | None", Any]


def find_bridge_state() -> weakref.ref | None:
    """A weak reference to the Megatron-Bridge ``GlobalState`` that one of the calling frames
    holds as a local, or ``None`` (Bridge not imported, or not in the call stack)."""
    state_module = sys.modules.get("megatron.bridge.training.state")
    if state_module is None:
        return None
    state_type = state_module.GlobalState
    frame = sys._getframe(1)
    while frame is not None:
        for value in frame.f_locals.values():
            if isinstance(value, state_type):
                return weakref.ref(value)
        frame = frame.f_back
    return None


def log_settings(log_interval: int | None, bridge_state: weakref.ref | None) -> LogSettings:
    """The loop's settings: Bridge's state where one was found, else Megatron-LM's global
    arguments where ``pretrain()`` parsed them, else ``(log_interval, None, None)``.
    ``log_interval`` (the adapter's own) overrides the loop's interval."""
    state = bridge_state() if bridge_state is not None else None
    if state is not None and state.cfg is not None:
        interval = log_interval if log_interval is not None else state.cfg.logger.log_interval
        # train() counts the step after train_step returns, as Megatron-LM's loop does.
        return interval, state.train_state.step + 1, state.tensorboard_logger
    try:
        from megatron.training import global_vars

        args = global_vars.get_args()
    except (ImportError, AssertionError):  # not under pretrain(): no arguments parsed
        return log_interval, None, None
    interval = log_interval if log_interval is not None else getattr(args, "log_interval", None)
    current = getattr(args, "curr_iteration", None)
    iteration = None if current is None else current + 1  # train() counts it after the step
    return interval, iteration, global_vars.get_tensorboard_writer()
