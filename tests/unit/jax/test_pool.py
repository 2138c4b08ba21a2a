"""The JAX pool against a NumPy model of it, and against the torch reference.

Random programs of stashes (random sizes, some over the pool or the static budget), pops in
random order and second pops; after every operation the pool's data, free list, owners,
counters, flags, every record and every popped tensor equal the model's byte for byte. The data
are random bit patterns (NaN payloads, infinities, signed zeros), so a copy that went through
arithmetic would show.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax")
pytestmark = pytest.mark.torch_free  # also run without torch (scripts/jax_env.sh)
jnp = jax.numpy

from te_paged.jax import STAMP, make_pool, overflowed, pop, reset_pool, stash  # noqa: E402
from te_paged.jax.pool import POOL_ID  # noqa: E402
from te_paged.kernels.layout import Flag, Meta, State, Tier  # noqa: E402

# One geometry for every example, so each function compiles once: 6 pages of 4 rows, a static
# buffer of 13 rows (4 page slots, the last partly used), hidden 3.
PAGES, PAGE, ROWS, HIDDEN = 6, 4, 13, 3
SLOTS = -(-ROWS // PAGE)
_stash = jax.jit(stash)
_pop = jax.jit(pop, static_argnums=2)


class NumpyPool:
    """The model: the reference's algorithm, one page and one row at a time."""

    def __init__(self) -> None:
        self.data = np.zeros((PAGES * PAGE, HIDDEN), np.uint32)
        self.free = list(range(PAGES))
        self.owner = [-1] * PAGES
        self.head, self.tail, self.hwm, self.rows_stashed, self.stamp = 0, PAGES, 0, 0, 0
        self.overflow = self.invalid = 0

    def stash(self, src: np.ndarray, n: int) -> tuple[list[int], int, int, int]:
        """Returns the record: (pages, rows, tier, stamp)."""
        stamp = self.stamp
        self.stamp += 1
        if self.overflow:
            return [-1] * SLOTS, 0, Tier.NONE, stamp
        if n < 0 or n > ROWS:  # a count the buffer cannot hold: invalid, not an overflow
            self.invalid += 1
            return [-1] * SLOTS, 0, Tier.NONE, stamp
        rows = -(-n // 1)
        need = -(-rows // PAGE)
        if need > self.tail - self.head:
            self.overflow += 1
            return [-1] * SLOTS, 0, Tier.NONE, stamp
        pages = [self.free[(self.head + i) % PAGES] for i in range(need)]
        for r in range(rows):
            self.data[pages[r // PAGE] * PAGE + r % PAGE] = src[r]
        for page in pages:
            self.owner[page] = stamp
        self.head += need
        self.hwm = max(self.hwm, PAGES - (self.tail - self.head))
        self.rows_stashed += rows
        return pages + [-1] * (SLOTS - need), rows, Tier.DEVICE, stamp

    def pop(self, record: tuple[list[int], int, int, int]) -> np.ndarray:
        pages, rows, tier, stamp = record
        out = np.zeros((ROWS, HIDDEN), np.uint32)
        need = -(-rows // PAGE)
        owned = all(self.owner[p] == stamp for p in pages[:need])
        if tier == Tier.DEVICE and not owned:
            self.invalid += 1
        if self.overflow or tier != Tier.DEVICE or not owned:
            return out
        for r in range(rows):
            out[r] = self.data[pages[r // PAGE] * PAGE + r % PAGE]
        for i, page in enumerate(pages[:need]):
            self.free[(self.tail + i) % PAGES] = page
            self.owner[page] = -1
        self.tail += need
        return out


def _assert_same(pool, model: NumpyPool) -> None:
    data = np.asarray(pool.pool_NH).view(np.uint32)
    assert np.array_equal(data, model.data), "pool data differ"
    assert np.asarray(pool.free_P).tolist() == model.free
    assert np.asarray(pool.owner_P).tolist() == model.owner
    state = np.asarray(pool.state).tolist()
    assert state[State.HEAD] == model.head and state[State.TAIL] == model.tail
    assert state[State.HWM] == model.hwm and state[State.ROWS_STASHED] == model.rows_stashed
    assert state[STAMP] == model.stamp
    assert state[State.HOST_HEAD] == state[State.HOST_TAIL] == state[State.SPILLED] == 0
    flags = np.asarray(pool.flags).tolist()
    assert flags[Flag.OVERFLOW] == model.overflow and flags[Flag.INVALID] == model.invalid
    assert flags[Flag.HOST_SPILL] == 0


# An operation: ("stash", tokens) with tokens up to 3 past the static budget, ("pop", i) of the
# i-th outstanding record (mod their number), ("repop", i) of an already popped one.
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("stash"), st.integers(0, ROWS + 3)),
        st.tuples(st.just("pop"), st.integers(0, 50)),
        st.tuples(st.just("repop"), st.integers(0, 50)),
    ),
    max_size=14,
)


def _random_rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, (ROWS, HIDDEN), dtype=np.uint32)


@settings(max_examples=100, deadline=None)
@given(ops=_ops, seed=st.integers(0, 2**16))
def test_stash_and_pop_match_the_numpy_model(ops, seed) -> None:
    pool, model = make_pool(PAGES, PAGE, HIDDEN), NumpyPool()
    outstanding, popped = [], []
    for k, (op, arg) in enumerate(ops):
        if op == "stash":
            bits = _random_rows(seed + k)
            pool, rec = _stash(pool, jnp.asarray(bits.view(np.float32)), jnp.int32(arg))
            want = model.stash(bits, arg)
            got = (
                np.asarray(rec.pages_M).tolist(),
                int(rec.meta[Meta.ROWS]),
                int(rec.meta[Meta.TIER]),
                int(rec.stamp[0]),  # then the pool id and generation
            )
            assert got == want
            assert int(rec.meta[Meta.POPPED]) == 0
            # Never truncated: stored whole, or flagged (an overflow, or an invalid count).
            assert want[1] == arg or (want[2] == Tier.NONE and model.overflow + model.invalid)
            outstanding.append((rec, want, bits, arg))
        elif op == "pop" and outstanding:
            rec, want, bits, n = outstanding.pop(arg % len(outstanding))
            pool, out = _pop(pool, rec, ROWS)
            expect = model.pop(want)
            out_bits = np.asarray(out).view(np.uint32)
            assert np.array_equal(out_bits, expect), "popped bytes differ from the model"
            if want[2] == Tier.DEVICE and not model.overflow:  # 0 corrupted bytes, 0 padding
                assert np.array_equal(out_bits[:n], bits[:n])
                assert not out_bits[n:].any()
            freed = want[2] == Tier.DEVICE and want[1] > 0 and not model.overflow
            popped.append((rec, want, freed))
        elif op == "repop" and popped:
            rec, want, freed = popped[arg % len(popped)]
            invalid = model.invalid
            pool, out = _pop(pool, rec, ROWS)
            assert np.array_equal(np.asarray(out).view(np.uint32), model.pop(want))
            if freed:  # a second pop of a record whose pages went back counts (and frees nothing)
                assert model.invalid == invalid + 1
        _assert_same(pool, model)
    assert bool(overflowed(pool)) == (model.overflow > 0)
    # See them with --hypothesis-show-statistics: the programs reach overflow and second pops.
    event(f"overflowed: {model.overflow > 0}")
    event(f"second pops counted: {model.invalid > 0}")


def test_overflow_is_flagged_and_later_stashes_are_no_ops() -> None:
    pool = make_pool(PAGES, PAGE, HIDDEN)
    x = jnp.ones((ROWS, HIDDEN))
    pool, a = _stash(pool, x, jnp.int32(ROWS))  # 4 pages
    pool, b = _stash(pool, x, jnp.int32(ROWS))  # 4 more: 2 free, flagged
    assert int(b.meta[Meta.TIER]) == Tier.NONE and int(pool.flags[Flag.OVERFLOW]) == 1
    pool, c = _stash(pool, x, jnp.int32(1))  # would fit, but the step is already invalid
    assert int(c.meta[Meta.TIER]) == Tier.NONE and int(pool.flags[Flag.OVERFLOW]) == 1
    pool, out = _pop(pool, a, ROWS)  # pops after an overflow read and free nothing
    assert not np.asarray(out).any() and int(pool.state[State.TAIL]) == PAGES
    pool = reset_pool(pool)
    assert not bool(overflowed(pool)) and np.asarray(pool.free_P).tolist() == list(range(PAGES))
    pool, d = _stash(pool, x, jnp.int32(ROWS + 1))  # over the static buffer: a wrong count
    assert int(d.meta[Meta.TIER]) == Tier.NONE and not bool(overflowed(pool))
    assert int(pool.flags[Flag.INVALID]) == 1  # invalid input, as the torch kernels say
    pool, e = _stash(pool, x, jnp.int32(-1))
    assert int(e.meta[Meta.TIER]) == Tier.NONE and int(pool.flags[Flag.INVALID]) == 2
    pool, f = _stash(pool, x, jnp.int32(1))  # the pool itself still works
    assert int(f.meta[Meta.TIER]) == Tier.DEVICE


def test_one_compilation_for_every_token_count() -> None:
    stash_fn = jax.jit(stash)
    pool = make_pool(PAGES, PAGE, HIDDEN)
    for n in (0, 1, 5, ROWS):
        pool, _ = stash_fn(reset_pool(pool), jnp.zeros((ROWS, HIDDEN)), jnp.int32(n))
    assert stash_fn._cache_size() == 1


def test_float_bookkeeping_gives_the_same_pool() -> None:
    ints = make_pool(PAGES, PAGE, HIDDEN)
    floats = make_pool(PAGES, PAGE, HIDDEN, differentiable=True)
    # Two pools, two identities: give the float one the int one's, to compare the rest.
    floats = floats._replace(state=floats.state.at[POOL_ID].set(ints.state[POOL_ID]))
    x = jnp.asarray(_random_rows(7).view(np.float32))
    for n in (5, 13, 2):
        ints, ri = stash(ints, x, n)
        floats, rf = stash(floats, x, n)
        assert all(np.array_equal(a, b) for a, b in zip(ri, rf))
    ints, oi = pop(ints, ri, ROWS)
    floats, of = pop(floats, rf, ROWS)
    assert np.array_equal(np.asarray(oi).view(np.uint32), np.asarray(of).view(np.uint32))
    assert np.array_equal(
        np.asarray(ints.pool_NH).view(np.uint32), np.asarray(floats.pool_NH).view(np.uint32)
    )
    for a, b in zip(ints[1:], floats[1:]):
        assert floats.state.dtype == jnp.float32
        assert np.array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))


def test_bad_input_raises() -> None:
    pool = make_pool(PAGES, PAGE, HIDDEN)
    with pytest.raises(ValueError, match=r"\[rows, 3\]"):
        stash(pool, jnp.zeros((ROWS, 4)), 1)
    with pytest.raises(TypeError, match="bfloat16"):
        stash(pool, jnp.zeros((ROWS, HIDDEN), jnp.bfloat16), 1)
    _, rec = stash(pool, jnp.zeros((ROWS, HIDDEN)), 1)
    with pytest.raises(ValueError, match="row count it was stashed with"):
        pop(pool, rec, ROWS + PAGE)
    with pytest.raises(ValueError, match="num_pages"):
        make_pool(0, PAGE, HIDDEN)


def test_same_pages_and_bytes_as_the_torch_reference() -> None:
    """A fixed program through both implementations: the same pages per record, the same
    free list and counters, the same bytes back (the torch reference has no stamps; its
    ``POPPED`` flag is what the JAX pool's page owners stand for)."""
    torch = pytest.importorskip("torch")
    from te_paged.kernels.layout import FLAGS_LEN, META_LEN, STATE_LEN
    from te_paged.kernels.reference import torch_stash_copy, torch_stash_pop

    t_pool = torch.zeros(PAGES * PAGE, HIDDEN, dtype=torch.int32)
    t_free = torch.arange(PAGES, dtype=torch.int32)
    t_state = torch.zeros(STATE_LEN, dtype=torch.int64)
    t_state[State.TAIL] = PAGES
    t_flags = torch.zeros(FLAGS_LEN, dtype=torch.int64)
    empty, no_free = torch.zeros(0, HIDDEN, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    pool = make_pool(PAGES, PAGE, HIDDEN)
    program = [("stash", 14), ("pop", 0), ("stash", -2), ("pop", 0),  # invalid counts
               ("stash", 9), ("stash", 3), ("pop", 0), ("stash", 13), ("pop", 1), ("stash", 5),
               ("pop", 0), ("stash", 12), ("pop", 0), ("pop", 0)]  # fmt: skip
    live: list[tuple] = []
    for k, (op, arg) in enumerate(program):
        if op == "stash":
            bits = _random_rows(100 + k)
            src = torch.from_numpy(bits.view(np.int32).copy())
            rec_pages, rec_meta = (
                torch.zeros(SLOTS, dtype=torch.int32),
                torch.zeros(META_LEN, dtype=torch.int64),
            )
            torch_stash_copy(src, torch.tensor([arg]), 1, PAGE, t_pool, t_free, empty, no_free,
                             t_state, t_flags, rec_pages, rec_meta)  # fmt: skip
            pool, rec = stash(pool, jnp.asarray(bits.view(np.float32)), arg)
            need = -(-int(rec_meta[Meta.ROWS]) // PAGE)
            assert np.asarray(rec.pages_M)[:need].tolist() == rec_pages[:need].tolist()
            assert np.asarray(rec.meta)[:2].tolist() == rec_meta[:2].tolist()
            live.append((rec, rec_pages, rec_meta))
        else:
            rec, rec_pages, rec_meta = live.pop(arg)
            dst = torch.full((ROWS, HIDDEN), 7, dtype=torch.int32)
            torch_stash_pop(dst, PAGE, t_pool, t_free, empty, no_free, t_state, t_flags,
                            rec_pages, rec_meta, True)  # fmt: skip
            pool, out = pop(pool, rec, ROWS)
            assert np.array_equal(np.asarray(out).view(np.int32), dst.numpy())
        assert np.array_equal(np.asarray(pool.pool_NH).view(np.int32), t_pool.numpy())
        assert np.asarray(pool.free_P).tolist() == t_free.tolist()
        assert np.asarray(pool.state)[:STATE_LEN].tolist() == t_state.tolist()
        assert np.asarray(pool.flags).tolist() == t_flags.tolist()


def test_the_worked_example_of_the_module_docstring() -> None:
    pool = make_pool(num_pages=4, page_size=2, hidden=1)
    x = jnp.arange(5.0)[:, None] + 1
    pool, a = stash(pool, x, 3)
    assert np.asarray(a.pages_M).tolist() == [0, 1, -1]
    assert np.asarray(pool.owner_P).tolist() == [0, 0, -1, -1]  # A's stamp is 0
    pool, b = stash(pool, x, 1)
    assert np.asarray(b.pages_M).tolist() == [2, -1, -1] and int(pool.state[State.HEAD]) == 3
    pool, c = stash(pool, x, 3)
    assert int(pool.flags[Flag.OVERFLOW]) == 1
    assert np.asarray(c.meta).tolist()[: Meta.POPPED] == [0, Tier.NONE]
    pool, out = pop(pool, a, 5)  # after the overflow: zeros, the pool as it was
    assert not np.asarray(out).any() and int(pool.state[State.TAIL]) == 4
    # Without the overflow, popping A returns its rows and pages 0, 1 to free slots 0, 1.
    pool = make_pool(num_pages=4, page_size=2, hidden=1)
    pool, a = stash(pool, x, 3)
    pool, b = stash(pool, x, 1)
    pool, out = pop(pool, a, 5)
    assert np.asarray(out)[:, 0].tolist() == [1, 2, 3, 0, 0]
    assert np.asarray(pool.free_P).tolist() == [0, 1, 2, 3] and int(pool.state[State.TAIL]) == 6
    pool, d = stash(pool, x, 4)  # the queue from head 3 holds pages [3 0 1]: d takes 3, then 0
    assert np.asarray(d.pages_M).tolist() == [3, 0, -1]


def test_bfloat16_rows_move_bit_for_bit_but_nan_payloads() -> None:
    """Every bf16 bit pattern through stash and pop: all arrive unchanged (-0.0, infinities,
    subnormals) except NaN payloads, which XLA's CPU backend canonicalises in any bf16 copy
    (see the pool's module docstring): exactly the NaNs differ, and they are still NaNs."""
    bits = np.arange(2**16, dtype=np.uint16).reshape(-1, 64)  # 1024 rows
    pool = make_pool(num_pages=17, page_size=64, hidden=64, dtype=jnp.bfloat16)
    src = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.bfloat16)
    pool, rec = stash(pool, jnp.concatenate([src, src[:5]]), bits.shape[0])
    pool, out = pop(pool, rec, bits.shape[0] + 5)
    got = np.asarray(jax.lax.bitcast_convert_type(out, jnp.uint16))
    assert not got[-5:].any()
    got = got[:-5]
    nan = (bits & 0x7FFF) > 0x7F80
    assert np.array_equal(got[~nan], bits[~nan])
    assert ((got[nan] & 0x7FFF) > 0x7F80).all()


def test_tokens_per_row_counts_rows_of_several_tokens() -> None:
    """An MXFP8-style scale-inverse: one row per 32 tokens, so 33 tokens are 2 rows and the
    static budget is R x 32 tokens."""
    pool = make_pool(PAGES, PAGE, HIDDEN)
    x = jnp.arange(ROWS * HIDDEN, dtype=jnp.float32).reshape(ROWS, HIDDEN)
    pool, rec = stash(pool, x, 33, tokens_per_row=32)
    assert int(rec.meta[Meta.ROWS]) == 2 and int(pool.state[State.ROWS_STASHED]) == 2
    pool, out = pop(pool, rec, ROWS)
    assert np.array_equal(out[:2], x[:2]) and not np.asarray(out[2:]).any()
    pool, rec = stash(pool, x, ROWS * 32 + 1, tokens_per_row=32)  # one token over the buffer
    assert int(rec.meta[Meta.TIER]) == Tier.NONE and int(pool.flags[Flag.INVALID]) == 1


def test_a_record_popped_from_another_pool_or_generation_or_too_short_is_invalid() -> None:
    x = jnp.asarray(_random_rows(3).view(np.float32))
    pool, other = make_pool(PAGES, PAGE, HIDDEN), make_pool(PAGES, PAGE, HIDDEN)
    pool, rec = stash(pool, x, 5)
    other, theirs = stash(other, x[::-1], 5)  # the same pages and stamp, in another pool
    wide = jnp.concatenate([x, x[:3]])  # 16 rows: the same 4 page slots as 13
    pool, long = stash(pool, wide, 15)  # pops into 13 rows would drop 2
    for name, target, record in (
        ("another pool", pool, theirs),
        ("after reset_pool", reset_pool(pool), rec),
        ("into fewer rows than it stored", pool, long),
    ):
        after, out = pop(target, record, ROWS)
        assert int(after.flags[Flag.INVALID]) == 1, name
        assert not np.asarray(out).any(), name  # nothing handed over
        assert np.array_equal(after.free_P, target.free_P), name  # nothing freed
        assert int(after.state[State.TAIL]) == int(target.state[State.TAIL]), name
    pool, out = pop(pool, rec, ROWS)  # the right pool, generation and rows
    assert int(pool.flags[Flag.INVALID]) == 0 and np.array_equal(out[:5], x[:5])


def test_a_float_token_count_is_refused() -> None:
    pool = make_pool(PAGES, PAGE, HIDDEN)
    with pytest.raises(TypeError, match="num_tokens must be an integer count, got float32"):
        stash(pool, jnp.zeros((ROWS, HIDDEN)), jnp.float32(3.7))
    with pytest.raises(TypeError, match="num_tokens must be an integer count"):
        stash(pool, jnp.zeros((ROWS, HIDDEN)), 3.7)
