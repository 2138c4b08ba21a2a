"""paged_checkpoint under paged_scope: the pool threaded through a lax.scan over layers, forward
as the carry and backward as the carry's cotangent; gradients bitwise those of plain JAX."""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytestmark = pytest.mark.torch_free  # also run without torch (scripts/jax_env.sh)
jnp = jax.numpy

from jax.ad_checkpoint import checkpoint_name  # noqa: E402

from te_paged.jax import make_pool, paged_checkpoint, paged_scope  # noqa: E402
from te_paged.kernels.layout import Flag, State  # noqa: E402

LAYERS, ROWS, HIDDEN, PAGE = 5, 12, 4, 4


def _weighted_sum(x_RH, w_R):
    """A combine-like fn: reads every row, so padding rows must be zero in both runs."""
    return jnp.sum(x_RH * w_R[:, None], axis=0)


# Remat policies for the layer's other work: none, recompute everything, save a named value.
POLICIES = {
    "saved": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "save_only_these_names": jax.checkpoint_policies.save_only_these_names("pre"),
}


def _model(params, x_RH, counts_L, pool, *, remat: str = "saved"):
    """A scanned stack: ``a = tanh(h @ w)`` (remat'd or not), its first counts[l] rows kept,
    then a weighted sum saved through the pool; the pool rides in the scan carry."""

    def inner(w, h_RH, n):
        keep_R = jnp.arange(ROWS) < n
        pre_RH = checkpoint_name(h_RH @ w, "pre")
        return jnp.where(keep_R[:, None], jnp.tanh(pre_RH), 0.0)

    if POLICIES[remat] is not None:
        inner = jax.checkpoint(inner, policy=POLICIES[remat])

    def layer(carry, inputs):
        h_RH, pool = carry
        w, v_R, n = inputs
        a_RH = inner(w, h_RH, n)
        y_H, pool = paged_checkpoint(_weighted_sum, a_RH, n, pool, v_R)
        return (h_RH + a_RH * jnp.sum(y_H), pool), None

    (h_RH, pool), _ = jax.lax.scan(layer, (x_RH, pool), (params["w"], params["v"], counts_L))
    return jnp.sum(h_RH**2), pool


def _inputs(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 3)
    params = {
        "w": jax.random.normal(k[0], (LAYERS, HIDDEN, HIDDEN)) / 2,
        "v": jax.random.normal(k[1], (LAYERS, ROWS)),
    }
    return params, jax.random.normal(k[2], (ROWS, HIDDEN))


@functools.cache
def _grads(remat: str):
    """(paged, plain) gradient functions of params, jitted once per remat setting."""
    scoped = paged_scope(functools.partial(_model, remat=remat))

    def paged(params, x, counts, pool):
        def loss(p, pool):
            out, flags = scoped(p, x, counts, pool)
            return out, flags

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, pool)

    def plain(params, x, counts):
        return jax.grad(lambda p: _model(p, x, counts, None, remat=remat)[0])(params)

    return jax.jit(paged), jax.jit(plain)


def _bitwise_equal(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("remat", sorted(POLICIES))
def test_grad_is_bitwise_the_plain_grad(remat: str) -> None:
    paged, plain = _grads(remat)
    params, x = _inputs()
    pages = LAYERS * -(-ROWS // PAGE)  # room for every layer's worst case
    for counts in ([12, 3, 0, 7, 9], [1, 12, 5, 5, 2]):  # different counts, one compilation
        counts = jnp.asarray(counts, jnp.int32)
        pool = make_pool(pages, PAGE, HIDDEN, differentiable=True)
        (grads, after), flags = paged(params, x, counts, pool)
        assert not np.asarray(flags).any()
        assert _bitwise_equal(grads, plain(params, x, counts))
        # Backward popped every record: all pages free, nothing counted invalid.
        state = np.asarray(after.state)
        assert state[State.TAIL] - state[State.HEAD] == pages
        assert state[State.HWM] == sum(-(-int(n) // PAGE) for n in counts)
        assert not np.asarray(after.flags).any()
    assert paged._cache_size() == 1


def test_overflow_is_reported_in_the_flags() -> None:
    paged, _ = _grads("saved")
    params, x = _inputs(1)
    counts = jnp.asarray([12, 12, 12, 12, 12], jnp.int32)  # 15 pages, the pool has 8
    (_, after), flags = paged(params, x, counts, make_pool(8, PAGE, HIDDEN, differentiable=True))
    assert int(flags[Flag.OVERFLOW]) == 1  # counted once; later stashes are no-ops
    assert int(after.state[State.TAIL]) == 8  # nothing was popped after the overflow


def test_pool_none_is_plain_jax_and_misuse_is_refused() -> None:
    x = jnp.ones((ROWS, HIDDEN))
    v = jnp.arange(ROWS, dtype=jnp.float32)
    y, pool = paged_checkpoint(_weighted_sum, x, 3, None, v)
    assert pool is None and np.array_equal(y, _weighted_sum(x, v))

    def scoped_call(pool):
        return paged_scope(lambda pool: paged_checkpoint(_weighted_sum, x, 3, pool, v))(pool)

    with pytest.raises(TypeError, match="differentiable=True"):
        scoped_call(make_pool(3, PAGE, HIDDEN))
    # Outside paged_scope backward would have no pool to pop from: refused at trace time.
    pool = make_pool(3, PAGE, HIDDEN, differentiable=True)
    with pytest.raises(RuntimeError, match="paged_scope"):
        jax.grad(lambda x: paged_checkpoint(_weighted_sum, x, 3, pool, v)[0].sum())(x)
    y, flags = scoped_call(pool)
    assert np.array_equal(y, _weighted_sum(x, v)) and not np.asarray(flags).any()
    # The OFF path through paged_scope too (before: AttributeError on None.flags).
    y, flags = scoped_call(None)
    assert flags is None and np.array_equal(y, _weighted_sum(x, v))
    grad = jax.grad(lambda x: paged_scope(lambda x, pool: paged_checkpoint(
        _weighted_sum, x, 3, pool, v))(x, None)[0].sum())(x)  # fmt: skip
    assert np.array_equal(grad, jax.grad(lambda x: _weighted_sum(x, v).sum())(x))


def test_the_pool_bytes_survive_forward_and_the_backward_threading() -> None:
    """Random float32 bit patterns (signalling NaNs included) stashed by a scan, threaded back
    through backward as the pool's cotangent: every byte of the pool is what was stashed."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, (LAYERS * ROWS, HIDDEN), dtype=np.uint32)
    bits[:ROWS] = 0x7F800001 + np.arange(ROWS * HIDDEN, dtype=np.uint32).reshape(ROWS, HIDDEN)
    data = jnp.asarray(bits.view(np.float32)).reshape(LAYERS, ROWS, HIDDEN)

    def f(w, data, pool):
        def layer(carry, x_RH):
            acc, pool = carry
            fn = lambda x, w: jnp.sum(jnp.nan_to_num(x) * w)
            y, pool = paged_checkpoint(fn, x_RH, ROWS, pool, w)
            return (acc + y, pool), None

        (acc, pool), _ = jax.lax.scan(layer, (jnp.float32(0), pool), data)
        return acc, pool

    pool = make_pool(LAYERS * ROWS // PAGE, PAGE, HIDDEN, differentiable=True)
    grad = jax.jit(jax.grad(paged_scope(f), argnums=(0, 2), has_aux=True))
    (_, after), flags = grad(jnp.float32(1), data, pool)
    assert not np.asarray(flags).any()
    assert np.array_equal(np.asarray(after.pool_NH).view(np.uint32), bits)


def test_a_pool_passed_twice_instead_of_threaded_is_flagged_invalid() -> None:
    # Misuse: the same pool handed to two paged_checkpoint calls (the second should take the
    # first's output). Both stash into the same pages; backward then pops the first record from
    # the zero "cotangent" of the discarded pool. Before, that pop read zeros as if they were
    # the rows (gradients off by up to 0.98) with every flag clean.
    v = jnp.arange(ROWS, dtype=jnp.float32)

    def misuse(x, pool):
        a = jnp.tanh(x)
        y1, _ = paged_checkpoint(_weighted_sum, a, 5, pool, v)  # its pool dropped
        y2, pool = paged_checkpoint(_weighted_sum, a * 2, 5, pool, v)  # from the stale pool
        return jnp.sum(y1 * y2), pool

    def threaded(x, pool):
        a = jnp.tanh(x)
        y1, pool = paged_checkpoint(_weighted_sum, a, 5, pool, v)
        y2, pool = paged_checkpoint(_weighted_sum, a * 2, 5, pool, v)
        return jnp.sum(y1 * y2), pool

    x = jax.random.normal(jax.random.key(3), (ROWS, HIDDEN))
    pool = make_pool(8, PAGE, HIDDEN, differentiable=True)
    for f, invalid in ((threaded, 0), (misuse, 1)):
        g = paged_scope(f)
        grads, pool_after = jax.grad(lambda x, p, g=g: g(x, p)[0], argnums=(0, 1))(x, pool)
        assert int(pool_after.flags[Flag.INVALID]) >= invalid, f.__name__
        if not invalid:
            assert int(pool_after.flags[Flag.INVALID]) == 0
            plain = jax.grad(lambda x, f=f: f(x, None)[0])(x)
            assert np.array_equal(grads, plain)
