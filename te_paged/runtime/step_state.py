"""What a training step changes besides gradients, taken before the step and put back before a
rerun, so that the rerun is the step that never overflowed.

A forward pass changes more than activations: module buffers (running statistics, a router's
token counts and expert bias), delayed-scaling FP8 state (Transformer Engine keeps an amax
history and scales in each module's ``fp8_meta``), and whatever else a framework keeps. The
runners restore three kinds of state:

* **module buffers** of the model chunks — every buffer in the first step, then only those a
  step has changed so far (torch bumps a tensor's version counter on every in-place write, so
  the changed ones are known after each step without a copy); a buffer that changes for the
  first time in a step that must rerun cannot be put back: the rerun goes ahead and the runner
  names it (``StepRecord.unrestored_state``) and tracks it from then on;
* **FP8 scaling state**: every tensor in a module's ``fp8_meta`` (Transformer Engine's
  ``scaling_fwd``/``scaling_bwd`` metas: ``amax_history``, ``scale``, ``scale_inv``), copied
  every step (te_paged's own FP8 storage — current scaling and MXFP8 — keeps no state across
  steps);
* any object of the :class:`Restorable` protocol, found among the model's modules or given to
  the runner (``PagedStashRunner(..., restorables=[...])``).

Worked example: a model with a BatchNorm-like ``running_mean`` and a router's ``expert_bias``
(changed by the optimizer hook, not by forward). Step 0: both copied (nothing known yet);
after it only ``running_mean``'s version moved, so from step 1 only it is copied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["ModuleState", "ModuleStateSnapshot", "Restorable"]


@runtime_checkable
class Restorable(Protocol):
    """State a step changes that a rerun must give back: ``snapshot()`` before the step returns
    what ``restore(state)`` puts back before a rerun (it may be called more than once with the
    same state)."""

    def snapshot(self) -> object: ...

    def restore(self, state: object) -> None: ...


@dataclasses.dataclass
class ModuleStateSnapshot:
    """Taken before a step: each buffer's identity and version, copies of the buffers known to
    change and of the FP8 metas, and the :class:`Restorable` objects' states."""

    versions: dict[str, tuple[int, int]]  # name -> (id of the tensor, version counter)
    buffers: dict[str, torch.Tensor]
    fp8: dict[str, torch.Tensor]
    restorables: list[object]


def _fp8_tensors(meta: Any, prefix: str, depth: int = 3) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of an ``fp8_meta`` (a dict of metas, each an object or dict of tensors),
    with dotted names; ``depth`` levels down at most (Transformer Engine's are two deep:
    ``fp8_meta["scaling_fwd"].amax_history``), so a reference cycle cannot loop."""
    if isinstance(meta, dict):
        items = list(meta.items())
    elif hasattr(meta, "__dict__") and not isinstance(meta, (nn.Module, type)):
        items = list(vars(meta).items())
    else:
        return
    for key, value in items:
        name = f"{prefix}.{key}"
        if isinstance(value, torch.Tensor):
            yield name, value
        elif depth > 1:
            yield from _fp8_tensors(value, name, depth - 1)


class ModuleState:
    """The buffers, FP8 metas and :class:`Restorable` s of ``chunks`` (see the module doc)."""

    def __init__(self, chunks: Iterable[nn.Module], restorables: Iterable[object] = ()) -> None:
        self.chunks = list(chunks)
        extra = list(restorables)
        for obj in extra:
            if not isinstance(obj, Restorable):
                raise TypeError(
                    f"{obj!r} is not Restorable: it needs snapshot() and restore(state)"
                )
        found = [m for c in self.chunks for m in c.modules() if isinstance(m, Restorable)]
        self.restorables = list({id(o): o for o in [*found, *extra]}.values())
        #: Buffers a step has changed so far (copied before every step); None: no step yet.
        self.changing: set[str] | None = None

    def _buffers(self) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
        out = {}
        for i, chunk in enumerate(self.chunks):
            for owner_name, owner in chunk.named_modules():
                for name, buf in owner.named_buffers(recurse=False):
                    if buf is not None:
                        full = ".".join(p for p in (str(i), owner_name, name) if p)
                        out[full] = (owner, name, buf)
        return out

    def _fp8(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, chunk in enumerate(self.chunks):
            for owner_name, owner in chunk.named_modules():
                meta = getattr(owner, "fp8_meta", None)
                if isinstance(meta, dict):
                    out.update(_fp8_tensors(meta, f"{i}.{owner_name}.fp8_meta"))
        return out

    def snapshot(self) -> ModuleStateSnapshot:
        buffers = self._buffers()
        versions = {n: (id(b), b._version) for n, (_, _, b) in buffers.items()}
        copy = buffers if self.changing is None else {
            n: v for n, v in buffers.items() if n in self.changing
        }  # fmt: skip
        return ModuleStateSnapshot(
            versions=versions,
            buffers={n: b.detach().clone() for n, (_, _, b) in copy.items()},
            fp8={n: t.detach().clone() for n, t in self._fp8().items()},
            restorables=[r.snapshot() for r in self.restorables],
        )

    def changed_since(self, snap: ModuleStateSnapshot) -> set[str]:
        """Buffers written (in place or replaced) since ``snap``, or new ones."""
        return {
            n
            for n, (_, _, b) in self._buffers().items()
            if snap.versions.get(n) != (id(b), b._version)
        }

    def learn(self, snap: ModuleStateSnapshot) -> None:
        """After a step: the buffers it changed are copied before every later step."""
        changed = self.changed_since(snap)
        self.changing = changed if self.changing is None else self.changing | changed

    def restore(self, snap: ModuleStateSnapshot) -> list[str]:
        """Put back what ``snap`` holds; returns the changed buffers it could not put back
        (not copied: they had never changed before), sorted."""
        changed = self.changed_since(snap)
        buffers = self._buffers()
        with torch.no_grad():
            for name, saved in snap.buffers.items():
                owner, attr, buf = buffers[name]
                if buf.shape == saved.shape and buf.dtype == saved.dtype:
                    buf.copy_(saved)
                else:  # replaced by a tensor of another shape: put a copy of the old one back
                    owner.register_buffer(attr, saved.clone(), persistent=attr not in (
                        owner._non_persistent_buffers_set
                    ))  # fmt: skip
            fp8 = self._fp8()
            for name, saved in snap.fp8.items():
                if name in fp8:
                    fp8[name].copy_(saved)
        for obj, state in zip(self.restorables, snap.restorables, strict=True):
            obj.restore(state)
        lost = sorted(changed - set(snap.buffers))
        if self.changing is not None:
            self.changing |= set(lost)
        return lost


@dataclasses.dataclass
class StepState:
    """What a step consumes or changes that a rerun must give back: every random generator it
    draws from (torch's CPU generator, each CUDA device's), the model's buffers, FP8 metas and
    :class:`~te_paged.runtime.step_state.Restorable` s (``modules``), and whatever a subclass
    adds in ``extra``."""

    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    modules: ModuleStateSnapshot | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
