"""Paged stash as a ``jax.custom_vjp``: a saved activation's actual rows go to the pool in
forward and come back, at their static shape, in backward.

Shape suffixes: ``R`` rows of the static buffer, ``H`` hidden.

**Why the pool is a carry in both directions.** Under ``lax.scan`` every per-layer residual is
stacked to ``[L, ...]`` at its static shape, so a pool saved as a residual would be copied per
layer, and per-layer compact buffers of the expected size would overflow on the first skewed
layer (the MaxText draft's bump pointer truncated there). The pool must be *one* value that
forward threads through the layers (the scan carry) and backward threads back through them in
reverse. JAX's reverse pass has exactly one such channel: the cotangent of the forward carry.
So :func:`paged_checkpoint` takes the pool as a differentiable input and returns it as an output,
and its backward rule receives "the cotangent of the pool after this stash" — which
:func:`paged_scope` arranges to be *the pool itself*, as backward has left it so far — pops from
it and hands the pool on as "the cotangent of the pool before this stash". The bookkeeping is
float32 for that reason (:func:`te_paged.jax.make_pool` with ``differentiable=True``).

    pool₀ ──stash₁──▶ pool₁ ──stash₂──▶ pool₂         forward: the scan carry
    pool₀' ◀──pop₁── pool₁' ◀──pop₂── pool₂ (seed)   backward: the carry's cotangent

:func:`paged_scope` seeds it: its forward runs the model under ``jax.vjp`` and keeps the final
pool (one pool, not one per layer) as its residual; its backward calls that VJP with the pool as
the cotangent of the pool output. ``jax.grad`` of the scoped function then just works, and the
stashed rows never appear among the scan's per-layer residuals: those are the records (a few
ints) and whatever else ``fn`` and the rest of the layer save.

``jax.checkpoint`` composes as usual around everything but the pool: remat the layer's other
work with any policy, and keep :func:`paged_checkpoint` outside the remat region — the inputs
of a ``jax.checkpoint`` are saved for its recompute, so a pool passed into one would be copied
per layer after all.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from te_paged.jax.pool import PagedPool, pop, stash

__all__ = ["paged_checkpoint", "paged_scope"]

# How many paged_scope calls are tracing their function now (a trace-time fact, per thread or
# task): a paged_checkpoint traced outside every scope would pop from an all-zero cotangent in
# backward — no pool at all — so it refuses to trace.
_SCOPES: contextvars.ContextVar[int] = contextvars.ContextVar("te_paged_jax_scopes", default=0)


@contextlib.contextmanager
def _tracing_scope() -> Iterator[None]:
    token = _SCOPES.set(_SCOPES.get() + 1)
    try:
        yield
    finally:
        _SCOPES.reset(token)


def paged_checkpoint(
    fn: Callable[..., Any],
    x_RH: jax.Array,
    num_tokens: jax.Array,
    pool: PagedPool | None,
    *args: Any,
) -> tuple[Any, PagedPool | None]:
    """``fn(x_RH, *args)``, saving ``x_RH``'s first ``num_tokens`` rows in ``pool`` instead of
    ``x_RH`` itself; returns ``(fn's output, the new pool)``.

    ====================  =========================================================
    forward               ``y = fn(x, *args)``; ``stash(pool, x, num_tokens)``
    backward              ``x' = pop(pool)`` (``x`` in rows ``< num_tokens``, zero
                          past them); the VJP of ``fn`` at ``(x', *args)``
    saves for backward    the record (``ceil(R/S) + 4`` int32) and ``args`` —
                          not ``R × H`` elements of ``x``
    ====================  =========================================================

    ``fn`` must not depend on ``x``'s rows from ``num_tokens`` on (they are padding: a MoE
    combine reads only the routed rows); then gradients are bitwise those of plain
    ``fn(x, *args)``, because backward runs the same operations on the same values. The pool's
    bookkeeping must be float32 (``make_pool(..., differentiable=True)``) and the call must sit
    under :func:`paged_scope`. With ``pool=None`` this is ``fn(x_RH, *args)`` and the pool stays
    ``None``, so one model function serves paged stash on and off.
    """
    if pool is None:
        return fn(x_RH, *args), None
    if _SCOPES.get() == 0:
        raise RuntimeError(
            "paged_checkpoint with a pool must run inside a function wrapped by paged_scope "
            "(g = paged_scope(f); jax.grad of g): only the scope hands backward the pool to pop "
            "from. Pass pool=None to run without paged stash."
        )
    if not jnp.issubdtype(pool.state.dtype, jnp.floating):
        raise TypeError(
            "paged_checkpoint threads the pool through backward as a cotangent, which an "
            f"integer array cannot carry (its bookkeeping is {pool.state.dtype}): make the pool "
            "with make_pool(..., differentiable=True)"
        )
    return _paged_call(fn, x_RH, num_tokens, pool, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _paged_call(fn, x_RH, num_tokens, pool, *args):
    return fn(x_RH, *args), stash(pool, x_RH, num_tokens)[0]


def _paged_fwd(fn, x_RH, num_tokens, pool, *args):
    pool, record = stash(pool, x_RH, num_tokens)
    # The static row count travels as the shape of an empty array: residuals are arrays.
    rows_R0 = jnp.zeros((x_RH.shape[0], 0), jnp.int8)
    return (fn(x_RH, *args), pool), (record, rows_R0, args)


def _paged_bwd(fn, residuals, cotangents):
    record, rows_R0, args = residuals
    ct_y, pool = cotangents  # the pool's "cotangent" is the pool as backward has left it
    pool, x_RH = pop(pool, record, rows_R0.shape[0])
    _, vjp = jax.vjp(fn, x_RH, *args)
    ct_x, *ct_args = vjp(ct_y)
    return (ct_x, None, pool, *ct_args)


_paged_call.defvjp(_paged_fwd, _paged_bwd)


def paged_scope(f: Callable[..., tuple[Any, PagedPool]]) -> Callable[..., tuple[Any, jax.Array]]:
    """Wrap ``f(*args, pool) -> (out, pool)`` so that ``jax.grad`` of it pops what it stashed.

    The result ``g(*args, pool) -> (out, flags)`` has ``f``'s output and the pool's flags after
    forward (``flags[Flag.OVERFLOW]`` non-zero: some stash found no room, the gradients are
    not valid and the step must be rerun without stashing). Differentiate with
    ``jax.grad(lambda *a: g(*a)[0])`` or ``has_aux``; the "gradient" with respect to ``pool``
    is the pool as backward left it (every page free again after a full step). Example::

        def f(params, x, pool):
            keep = (jnp.arange(x.shape[0]) < num_tokens)[:, None]  # the rest is padding

            def layer(carry, w):
                h, pool = carry
                a = jnp.where(keep, jnp.tanh(h @ w), 0.0)
                y, pool = paged_checkpoint(jnp.square, a, num_tokens, pool)  # a: paged
                return (h + y, pool), None

            (h, pool), _ = jax.lax.scan(layer, (x, pool), params)
            return jnp.sum(h), pool

        g = paged_scope(f)
        grads = jax.grad(lambda p: g(p, x, pool)[0])(params)  # == f(p, x, None)'s, bitwise
    """

    @jax.custom_vjp
    def scoped(*args_and_pool):
        with _tracing_scope():
            out, pool = f(*args_and_pool)
        return out, pool.flags

    def fwd(*args_and_pool):
        with _tracing_scope():
            (out, pool), vjp = jax.vjp(f, *args_and_pool)
        return (out, pool.flags), (vjp, pool)

    def bwd(residuals, cotangents):
        vjp, pool = residuals
        ct_out, _ = cotangents  # flags: no gradient
        return vjp((ct_out, pool))

    scoped.defvjp(fwd, bwd)

    @functools.wraps(f)
    def scoped_or_plain(*args_and_pool):
        if args_and_pool[-1] is not None:
            return scoped(*args_and_pool)
        # The OFF path, as paged_checkpoint's pool=None: plain JAX, and no flags to return.
        out, pool = f(*args_and_pool)
        if pool is not None:
            raise TypeError(f"paged_scope: f was given pool=None and returned a {type(pool)}")
        return out, None

    return scoped_or_plain
