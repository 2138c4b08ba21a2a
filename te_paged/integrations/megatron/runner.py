"""``MegatronPagedStashRunner``: Megatron-core's ``forward_backward_func``, rerun when a static
budget overflowed, with a result equal to a run that never overflowed.

Usage (the one change to a Megatron training loop; see docs/megatron.md)::

    runner = MegatronPagedStashRunner(model, optimizer)            # model: list of DDP chunks
    ...
    losses, record = runner(forward_step_func=forward_step, data_iterator=data_iterator,
                            model=model, num_microbatches=n, seq_length=s,
                            micro_batch_size=b, forward_only=False)
    update_successful, grad_norm, num_zeros = optimizer.step()

It takes the keyword arguments of Megatron's ``forward_backward_func`` (the function itself
comes from ``get_forward_backward_func()``, or ``forward_backward_func=`` at construction) and
returns ``(what the function returned, StepRecord)``. On top of :class:`PagedStashRunner`
(reset of every manager, one world-wide reduction of [overflow, over budget, host spill, step
index] per step, dropless rerun without stashing, runaway guard), for Megatron it:

* pre-reads the step's microbatches (``num_microbatches`` items from each data iterator, as
  Megatron's own paged-stash runner does) and hands every attempt a fresh iterator over them,
  so a rerun replays identical data;
* snapshots, and restores before a rerun, every random generator the step draws from: torch's
  CPU and CUDA generators and the states of Megatron's ``get_cuda_rng_tracker()`` (dropout in
  tensor- and expert-parallel regions) — so a rerun with dropout draws the same masks;
* restores what the failed attempt changed outside the gradients: Megatron's MoE aux-loss /
  load-balancing tracker (``get_moe_layer_wise_logging_tracker``), and, as every runner does,
  the model's buffers (the routers' ``expert_bias`` and ``local_tokens_per_expert``, which
  aux-loss-free balancing updates in ``finalize_model_grads`` at the end of the failed
  attempt), Transformer Engine's ``fp8_meta`` scaling state and any ``Restorable``;
* zeroes what the failed attempt accumulated: ``param.grad``, each DDP chunk's grad buffers
  (``zero_grad_buffer()``: ``main_grad``) and the optimizer's gradients.

The flags are reduced over the whole world (every pipeline stage and expert group reruns
together). Importing this module does not import Megatron.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from te_paged.runtime import PagedStashRunner, StepRecord, StepState

__all__ = ["MegatronPagedStashRunner"]

_REQUIRED = ("forward_step_func", "data_iterator", "model", "num_microbatches")


def _check_arguments(model: object, optimizer: object, config: object) -> None:
    """Arguments in the wrong order or of the wrong kind, refused when the runner is built
    (before: accepted, then an AttributeError at the first rerun)."""
    chunks = [model] if isinstance(model, nn.Module) else model
    if not isinstance(chunks, (list, tuple)) or not chunks:
        raise TypeError(
            "model must be a module or a non-empty list of model chunks, got "
            f"{type(model).__name__}"
        )
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, nn.Module):
            raise TypeError(f"model[{i}] must be a torch.nn.Module, got {type(chunk).__name__}")
    if optimizer is not None and (
        isinstance(optimizer, nn.Module) or not callable(getattr(optimizer, "zero_grad", None))
    ):
        raise TypeError(
            "optimizer must be Megatron's optimizer (anything with zero_grad()), got "
            f"{type(optimizer).__name__}: MegatronPagedStashRunner(model, optimizer, config)"
        )
    looks_wrong = isinstance(config, nn.Module) or callable(getattr(config, "zero_grad", None))
    if config is not None and looks_wrong:  # a model chunk or an optimizer in its place
        raise TypeError(
            f"config must be the model's TransformerConfig, got {type(config).__name__}: "
            "MegatronPagedStashRunner(model, optimizer, config)"
        )


def _clone_rng(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, torch.Generator):  # a CUDA-graph-safe tracker keeps generators
        return state.clone_state()
    return copy.deepcopy(state)


def _prefetch(data_iterator: Any, num_microbatches: int) -> tuple[Any, bool]:
    """The step's microbatches: ``num_microbatches`` items of each iterator (``None`` stays)."""

    def take(it: Iterator | None, chunk: int) -> list | None:
        if it is None:
            return None
        items = []
        for i in range(num_microbatches):
            try:
                items.append(next(it))
            except StopIteration:
                raise ValueError(
                    f"data iterator {chunk} ran out after {i} of {num_microbatches} "
                    "microbatches: the runner pre-reads num_microbatches items per step "
                    "so that a rerun replays the same data"
                ) from None
        return items

    if isinstance(data_iterator, list):
        return [take(it, i) for i, it in enumerate(data_iterator)], True
    return take(data_iterator, 0), False


def _replay(data: Any, is_list: bool) -> Any:
    if is_list:
        return [None if d is None else iter(d) for d in data]
    return None if data is None else iter(data)


def _chunk_config(chunk: nn.Module) -> object:
    """The config of a model chunk, through wrappers (``.module``); ``None`` if it has none."""
    module: object = chunk
    while module is not None:
        config = getattr(module, "config", None)
        if config is not None:
            return config
        module = getattr(module, "module", None)
    return None


def _refuse_megatron_stash(model: nn.Module | list[nn.Module]) -> None:
    """``ValueError`` when ``model`` holds experts that stash into Megatron's own paged stash
    (megatron-core 0.19.2's ``TEGroupedMLP`` on its op-fuser path with ``moe_paged_stash``):
    their process-global manager is reset and read by Megatron's ``PagedStashRunner`` only, so
    under this runner an overflow there would go unseen."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    chunks = [model] if isinstance(model, nn.Module) else list(model)
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if (
                isinstance(module, TEGroupedMLP)
                and getattr(module, "_with_fused_impl", False)  # 0.19.2's op-fuser path
                and getattr(module.config, "moe_paged_stash", False)
            ):
                raise ValueError(
                    f"{name} is Megatron's own TEGroupedMLP on the op-fuser path with "
                    "moe_paged_stash=True: it stashes into Megatron's built-in paged stash, "
                    "whose flags MegatronPagedStashRunner does not read. Either build the MoE "
                    "layers with te_paged.integrations.megatron.get_te_paged_moe_spec(config) "
                    "(te_paged's experts and stash; the config's moe_paged_stash* fields carry "
                    "over), or keep Megatron's experts under Megatron's own PagedStashRunner"
                )


class MegatronPagedStashRunner(PagedStashRunner):
    """Megatron's step under the paged-stash runner; see the module docstring.

    ``MegatronPagedStashRunner(model, optimizer=None, config=None, *, forward_backward_func=None,
    max_consecutive_fallbacks=3, grow_pool=True, grow_headroom=1.10, per_rank_pools=False,
    max_pool_bytes=None, grow_capacity=True, capacity_headroom=1.10, max_capacity_factor=None,
    auto_wire_steps=8, measure_fallback_memory=False, before_rerun=None, keep_records=1000,
    on_record=None, timeout=None, restorables=(), max_tokens_per_rank=None)``:
    ``model`` is the list of model chunks (Megatron DDP wrappers, or bare modules) or one chunk;
    ``optimizer`` Megatron's optimizer (its gradients are zeroed before a rerun); ``config`` the
    model's ``TransformerConfig`` (default: the first chunk's). ``before_rerun`` runs after
    everything above was restored and zeroed; the pool sizing (``grow_pool`` and the rest), the
    wire's (``grow_capacity`` and the rest),
    ``records``, ``on_record``, ``timeout``, ``restorables`` and ``max_tokens_per_rank`` (the
    largest microbatch, ``seq_length x micro_batch_size`` tokens of the longest one, for a
    variable-length run with megatron-core's ``variable_seq_lengths``) as in
    :class:`PagedStashRunner`.
    """

    def __init__(
        self,
        model: nn.Module | list[nn.Module],
        optimizer: object = None,
        config: object = None,
        *,
        forward_backward_func: Callable[..., Any] | None = None,
        max_consecutive_fallbacks: int = 3,
        grow_pool: bool = True,
        grow_headroom: float = 1.10,
        per_rank_pools: bool = False,
        max_pool_bytes: int | None = None,
        grow_capacity: bool = True,
        capacity_headroom: float = 1.10,
        max_capacity_factor: float | None = None,
        auto_wire_steps: int = 8,
        measure_fallback_memory: bool = False,
        before_rerun: Callable[[], None] | None = None,
        keep_records: int = 1000,
        on_record: Callable[[StepRecord], None] | None = None,
        timeout: datetime.timedelta | None = None,
        restorables: Iterable[object] = (),
        max_tokens_per_rank: int | None = None,
    ) -> None:
        _check_arguments(model, optimizer, config)
        _refuse_megatron_stash(model)
        super().__init__(
            model,
            group=None,  # the whole world: all pipeline stages and expert groups rerun together
            max_consecutive_fallbacks=max_consecutive_fallbacks,
            grow_pool=grow_pool,
            grow_headroom=grow_headroom,
            per_rank_pools=per_rank_pools,
            max_pool_bytes=max_pool_bytes,
            grow_capacity=grow_capacity,
            capacity_headroom=capacity_headroom,
            max_capacity_factor=max_capacity_factor,
            auto_wire_steps=auto_wire_steps,
            measure_fallback_memory=measure_fallback_memory,
            before_rerun=before_rerun,
            keep_records=keep_records,
            on_record=on_record,
            timeout=timeout,
            restorables=restorables,
            max_tokens_per_rank=max_tokens_per_rank,
        )
        from megatron.core.utils import get_model_config

        self.optimizer = optimizer
        self.config = config if config is not None else get_model_config(self.chunks[0])
        # What Megatron's schedules and GPTModel.forward read moe_paged_stash from (distinct).
        configs = [self.config, *(_chunk_config(c) for c in self.chunks)]
        self._configs = list({id(c): c for c in configs if c is not None}.values())
        self.forward_backward_func = forward_backward_func
        self._forward_only = False
        #: True while a call runs: a forward outside one, without autograd and in eval mode,
        #: is an inference pass between steps (the layers run it dropless, no flag).
        self.in_step = False
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            self.stage = parallel_state.get_pipeline_model_parallel_rank()

    def __call__(self, *, iteration: int | None = None, **kwargs: Any) -> tuple[Any, StepRecord]:
        """One step: ``forward_backward_func(**kwargs)``, rerun if a budget overflowed.

        ``iteration`` (not passed on) is the training loop's iteration number, compared across
        ranks to catch a rank that skipped a step (see :meth:`PagedStashRunner.step`).
        """
        missing = [k for k in _REQUIRED if k not in kwargs]
        if missing:
            raise TypeError(
                f"MegatronPagedStashRunner takes forward_backward_func's keyword arguments; "
                f"missing {missing}"
            )
        self._check_call(iteration, kwargs)
        func = self.forward_backward_func
        if func is None:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            func = get_forward_backward_func()
        data, is_list = _prefetch(kwargs["data_iterator"], kwargs["num_microbatches"])
        self._forward_only = bool(kwargs.get("forward_only", False))

        def step_fn() -> Any:
            with self._builtin_stash_hooks_off():
                return func(**{**kwargs, "data_iterator": _replay(data, is_list)})

        self.in_step = True
        try:
            return self.step(step_fn, step=iteration, forward_only=self._forward_only)
        finally:
            self.in_step = False

    def _check_call(self, iteration: object, kwargs: dict[str, Any]) -> None:
        """The call's own mistakes, named as the caller wrote them, before anything runs."""
        if iteration is not None and (
            not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0
        ):
            raise ValueError(f"iteration must be a non-negative int, got {iteration!r}")
        n = kwargs["num_microbatches"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"num_microbatches must be an int >= 1, got {n!r}")
        model = kwargs["model"]
        given = [model] if isinstance(model, nn.Module) else list(model)
        if [id(m) for m in given] != [id(c) for c in self.chunks]:
            raise ValueError(
                "model= is not the model this MegatronPagedStashRunner was built over (its "
                "stash managers and dispatchers would never be reset or read): build one runner "
                "per model and pass it the same chunks, in the same order"
            )

    @contextlib.contextmanager
    def _builtin_stash_hooks_off(self) -> Iterator[None]:
        """megatron-core 0.19.2's own stash hooks off for one ``forward_backward_func`` call.

        With ``config.moe_paged_stash`` the schedules call ``paged_stash_reset()`` and
        ``GPTModel.forward`` calls ``preprocess_for_paged_stash()`` on Megatron's process-global
        stash manager. te_paged's layers read the field once, when built, and never stash into
        that manager, so its bookkeeping is dead weight — and, being global, it carries one
        model's pipeline layout into the next model of the process (a 1F1B model then an
        interleaved one: ``update_model_chunk`` indexes past its list). The runner turns the
        field off on the model's configs for the call, as Megatron's own ``PagedStashRunner``
        does for its fallback (``_set_moe_paged_stash_all``), and puts it back after.
        """
        configs = [c for c in self._configs if getattr(c, "moe_paged_stash", False)]
        for c in configs:
            c.moe_paged_stash = False
        try:
            yield
        finally:
            for c in configs:
                c.moe_paged_stash = True

    # ------------------------------------------------------------------------ state and grads

    def snapshot_state(self) -> StepState:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        state = super().snapshot_state()
        tracker = get_cuda_rng_tracker()
        state.extra["rng_tracker"] = {n: _clone_rng(s) for n, s in tracker.get_states().items()}
        state.extra["aux_losses"] = {
            name: entry["values"].clone()
            for name, entry in get_moe_layer_wise_logging_tracker().items()
        }
        return state

    def restore_state(self, state: StepState) -> None:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        super().restore_state(state)
        saved = state.extra["rng_tracker"]
        get_cuda_rng_tracker().set_states({n: _clone_rng(s) for n, s in saved.items()})
        losses = state.extra["aux_losses"]
        for name, entry in get_moe_layer_wise_logging_tracker().items():
            if name in losses:
                entry["values"].copy_(losses[name])
            else:  # created by the failed attempt
                entry["values"].zero_()

    def clear_gradients(self) -> None:
        if self._forward_only:
            return
        super().clear_gradients()
        for chunk in self.chunks:
            # Megatron's DDP wrappers keep gradients in buffers (`param.main_grad`).
            zero_grad_buffer = getattr(chunk, "zero_grad_buffer", None)
            if zero_grad_buffer is not None:
                zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()
