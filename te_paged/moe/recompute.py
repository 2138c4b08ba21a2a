"""Selective recompute that owns its output's memory: ``CheckpointWithoutOutput``.

Usage (the ``moe_act`` pattern)::

    ckpt = CheckpointWithoutOutput()
    act = ckpt.checkpoint(activation, fc1_out, probs)   # act is not kept for backward
    out = fc2(act)                                       # fc2 saves a view of act
    ckpt.discard_output_and_register_recompute(out)      # free act's storage now

After forward the activation output's storage is resized to zero; just before ``out``'s backward
node runs, the activation is recomputed from its (saved) inputs and its values are written back
into the *same storage*, so every view the next op saved sees them. The storage is marked
recompute-managed (:func:`te_paged.markers.mark_recompute_managed`), so the paged stash never
takes ownership of any alias of it: recompute stays its sole owner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from te_paged.markers import mark_recompute_managed

__all__ = ["CheckpointWithoutOutput"]


class _CheckpointFunction(torch.autograd.Function):
    """Run ``fn`` without building a graph; backward replays it with grad enabled.

    ============  =========================================================
    saves         the inputs of ``fn`` (whatever markers they carry apply)
    does not save the outputs (their storage is freed after forward)
    ============  =========================================================
    """

    @staticmethod
    def forward(ctx, fn: Callable[..., Any], ckpt: CheckpointWithoutOutput, *args: Any):
        tensor_idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.fn, ctx.ckpt = fn, ckpt
        ctx.tensor_idx = tensor_idx
        ctx.args = [None if i in tensor_idx else a for i, a in enumerate(args)]
        ctx.save_for_backward(*(args[i] for i in tensor_idx))
        with torch.no_grad():
            outputs = fn(*args)
        ckpt._ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ckpt: CheckpointWithoutOutput = ctx.ckpt
        if ckpt._recomputed is None:  # no hook ran (e.g. output was never discarded)
            ckpt._recompute()
        outputs, inputs = ckpt._recomputed
        ckpt._recomputed = None
        outs = [o for o in (outputs if isinstance(outputs, tuple) else (outputs,))]
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [None] * len(ctx.args)
        for i, t in zip(ctx.tensor_idx, inputs):
            input_grads[i] = t.grad if t.requires_grad else None
        # The graph keeps ctx (and so ckpt) until the step's loss goes, and ctx and ckpt refer
        # to each other: without this the refilled outputs (static size, one per layer) would
        # outlive their use until then.
        ckpt._release()
        return (None, None, *input_grads)


class CheckpointWithoutOutput:
    """One checkpointed call whose output memory is freed after use and refilled in backward."""

    def __init__(self) -> None:
        self._ctx: Any = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._recomputed: tuple[Any, list[torch.Tensor]] | None = None

    def checkpoint(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)`` without saving its outputs for backward."""
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "CheckpointWithoutOutput does not compile: it frees its output's storage after "
                "forward and refills it in place in backward, which torch.compile's graphs do "
                "not express. With te_paged's experts, recompute_modules=['moe_act'] compiles "
                "on the op-fuser path (use_transformer_engine_op_fuser=True), which recomputes "
                "the activation inside its own function; or leave the experts eager"
            )
        if self._ctx is not None:
            raise RuntimeError("a CheckpointWithoutOutput instance checkpoints one call")
        outputs = _CheckpointFunction.apply(fn, self, *args)
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        for o in outs:
            if o.storage_offset() != 0 or not o.is_contiguous():
                raise ValueError("checkpointed outputs must be fresh contiguous tensors")
            mark_recompute_managed(o)
        self._outputs = outs
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' storage; recompute them before ``hook_tensor``'s backward runs."""
        if self._ctx is None:
            raise RuntimeError("call checkpoint() before discard_output_and_register_recompute()")
        if hook_tensor.grad_fn is None:
            raise ValueError("hook_tensor has no grad_fn: nothing would trigger the recompute")
        for o in self._outputs:
            o.untyped_storage().resize_(0)
        hook_tensor.grad_fn.register_prehook(lambda grads: self._recompute())

    def _release(self) -> None:
        self._ctx, self._outputs, self._recomputed = None, (), None

    def _recompute(self) -> None:
        if self._recomputed is not None:
            return
        if self._ctx is None:  # only a released checkpoint gets here without its context
            raise RuntimeError(
                "CheckpointWithoutOutput recomputes once: its outputs were released after the "
                "first backward (a second backward through the same graph is not supported)"
            )
        ctx = self._ctx
        saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in saved]
        args = list(ctx.args)
        for i, t in zip(ctx.tensor_idx, inputs):
            args[i] = t
        with torch.enable_grad():
            outputs = ctx.fn(*args)
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        for stale, fresh in zip(self._outputs, outs):
            # Refill the original storage (bypassing autograd's version counter, which the
            # views saved by the next op share): they see the recomputed values.
            storage = stale.untyped_storage()
            fresh = fresh.detach().contiguous()
            storage.resize_(fresh.untyped_storage().nbytes())
            storage.copy_(fresh.untyped_storage())
        self._recomputed = (outputs, inputs)
