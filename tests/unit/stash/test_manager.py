"""The manager's scope: what is paged, what passes through, sizing, lifecycle and parity."""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import ClassVar

import pytest
import torch

from te_paged import (
    PagedStashBuffer,
    PagedStashManager,
    StashKey,
    StashMode,
    mark_grouped_tensor,
    mark_recompute_managed,
)
from te_paged.config import MoEConfig


class MarkedLinear(torch.autograd.Function):
    """``y = x @ wᵀ`` that marks its saved input, like GroupedLinear does."""

    @staticmethod
    def forward(ctx, x, w, mark: bool = True):
        if mark:
            mark_grouped_tensor(x)
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x, None


class Keep(torch.autograd.Function):
    """Saves its input as is; backward hands back what autograd gave it."""

    seen: ClassVar[list[torch.Tensor]] = []

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        Keep.seen.append(x)
        return g


def run_model(manager: PagedStashManager | None, step: int, rows=40, hidden=16, layers=3):
    torch.manual_seed(step)
    n = 17 + 5 * step
    x = torch.randn(rows, hidden)
    # padding rows hold stale values; the stash reloads them as zeros, which must not matter
    x.requires_grad_()
    ws = [torch.randn(hidden, hidden, requires_grad=True) for _ in range(layers)]
    num_tokens = torch.tensor(n)
    mask = (torch.arange(rows) < n)[:, None]
    h = x
    for w in ws:
        cm = manager.scope(rows, num_tokens, 20) if manager else contextlib.nullcontext()
        with cm:
            h = torch.where(mask, torch.tanh(MarkedLinear.apply(h, w)), 0.0)
    h.sum().backward()
    return [h.detach(), x.grad[:n], *(w.grad for w in ws)]


def test_gradients_bitwise_identical_with_and_without_stash() -> None:
    manager = PagedStashManager(
        page_size=8, buffer_size_factor_cuda=1.5, skip_immediate_backward=False
    )
    for step in range(3):
        manager.reset()
        on = run_model(manager, step)
        off = run_model(None, step)
        assert all(torch.equal(a, b) for a, b in zip(on, off)), f"step {step}"
        stats = manager.stats()
        assert stats.stashes == stats.pops == 3
        assert not stats.overflow
        assert stats.mode is (StashMode.CAPTURE if step == 0 else StashMode.CAPTURED)
        if step:
            assert max(stats.pages_high_water.values()) > 0


def test_capture_learns_peaks_and_next_reset_allocates_once() -> None:
    manager = PagedStashManager(
        page_size=8, buffer_size_factor_cuda=1.5, skip_immediate_backward=False
    )
    run_model(manager, 0)
    stats = manager.stats()
    # three layers live at once: 3 x 17 actual rows, 3 x 20 balanced rows
    assert stats.capture_peak_rows == {"float32x16": 51}
    assert stats.capture_peak_balanced_rows == {"float32x16": 60}
    assert manager.buffers == {}
    manager.reset()
    (buffer,) = manager.buffers.values()
    assert buffer.num_pages == math.ceil(1.5 * 3 * math.ceil(20 / 8)) == 14
    ptr = buffer.pool_NH.data_ptr()
    for step in (1, 2):
        run_model(manager, step)
        manager.reset()
        assert manager.buffers[buffer.key] is buffer and buffer.pool_NH.data_ptr() == ptr


@pytest.mark.parametrize(
    ("factor", "pages"),
    [
        # Megatron's sign convention (te_paged/stash/sizing.py). Three layers live at once,
        # 17 real and 20 balanced rows each, pages of 8: balanced peak 3 x 3 = 9 pages,
        # observed peak 3 x 3 = 9 pages too; so use a page size that tells them apart below.
        (1.5, math.ceil(1.5 * 3 * math.ceil(20 / 6))),  # x the balanced peak: 18
        (-1.5, math.ceil(1.5 * 3 * math.ceil(17 / 6))),  # x the observed peak: 14
        (-1.0, 3 * math.ceil(17 / 6)),  # exactly what the capture step held: 9
    ],
)
def test_the_factors_sign_chooses_the_balanced_or_the_observed_peak(
    factor: float, pages: int
) -> None:
    manager = PagedStashManager(
        page_size=6, buffer_size_factor_cuda=factor, skip_immediate_backward=False
    )
    run_model(manager, 0)
    stats = manager.stats()
    assert stats.capture_peak_balanced_pages == {"float32x16": 12}
    assert stats.capture_peak_pages == {"float32x16": 9}
    manager.reset()
    (buffer,) = manager.buffers.values()
    assert buffer.num_pages == pages
    # Step 1 has 22 real rows per layer: 3 x 4 = 12 pages live at once. A pool sized to the
    # capture step's 9 observed pages overflows (flagged, never silent); the others fit, ON == OFF.
    on, off = run_model(manager, 1), run_model(None, 1)
    assert manager.stats().overflow == (pages < 12)
    if pages >= 12:
        assert all(torch.equal(a, b) for a, b in zip(on, off))


def test_a_negative_host_factor_sizes_the_host_tier_from_the_observed_peak() -> None:
    manager = PagedStashManager(
        page_size=6,
        buffer_size_factor_cuda=0.2,
        buffer_size_factor_cpu=-2,
        skip_immediate_backward=False,
    )
    run_model(manager, 0)
    manager.reset()
    (buffer,) = manager.buffers.values()
    assert buffer.num_pages == math.ceil(0.2 * 12)
    assert buffer.host_num_pages == 2 * 9


def test_capture_step_holds_only_actual_rows() -> None:
    manager = PagedStashManager(page_size=8, skip_immediate_backward=False)
    run_model(manager, 0)
    assert manager.stats().bytes_stashed == 3 * 17 * 16 * 4  # 3 layers x 17 rows, not 40


def test_unmarked_tensors_pass_through_untouched() -> None:
    manager = PagedStashManager(page_size=4, skip_immediate_backward=False)
    x = torch.randn(8, 4, requires_grad=True)
    y = x * 2  # non-leaf, requires grad
    Keep.seen.clear()
    with manager.scope(8, torch.tensor(3), 4):
        out = Keep.apply(y)
    out.sum().backward()
    # the same memory (not copied) and the same autograd history (not detached)
    assert Keep.seen[0].data_ptr() == y.data_ptr() and Keep.seen[0].grad_fn is y.grad_fn
    assert manager.stats().stashes == 0


def test_recompute_managed_views_are_left_alone() -> None:
    # GroupedLinear reshapes/splits its input before saving: the marker must be storage-level.
    manager = PagedStashManager(page_size=4, skip_immediate_backward=False)
    act = torch.randn(8, 6)
    mark_recompute_managed(act)
    view = act.reshape(16, 3)
    mark_grouped_tensor(view)  # producer marked it, but recompute owns the storage
    Keep.seen.clear()
    with manager.scope(16, torch.tensor(5), 8):
        out = Keep.apply(view.requires_grad_())
    out.sum().backward()
    assert Keep.seen[0].data_ptr() == view.data_ptr()
    assert manager.stats().stashes == 0


def test_non_divisible_numel_is_a_clear_error() -> None:
    manager = PagedStashManager(page_size=4, skip_immediate_backward=False)
    t = torch.randn(7, 3, requires_grad=True)
    mark_grouped_tensor(t)
    with manager.scope(8, torch.tensor(2), 4), pytest.raises(ValueError, match="21 elements"):
        Keep.apply(t)


@pytest.mark.parametrize("shape", [(4, 8), (2, 16), (32,)])
def test_a_marked_tensor_that_is_not_token_major_is_refused(shape) -> None:
    # Before: numel 32 divides by the 8 rows, so a transposed [4, 8] or flattened tensor was
    # paged as [8, 4] rows and a prefix of "rows" kept: elements lost without a word.
    manager = PagedStashManager(page_size=4, skip_immediate_backward=False)
    t = torch.randn(*shape, requires_grad=True)
    mark_grouped_tensor(t)
    with manager.scope(8, torch.tensor(2), 4), pytest.raises(ValueError, match="not token-major"):
        Keep.apply(t)


def test_scale_inverse_needs_a_budget_multiple_of_32() -> None:
    manager = PagedStashManager(page_size=4, skip_immediate_backward=False)
    s = torch.randn(2, 3, requires_grad=True)
    mark_grouped_tensor(s, scale_inv=True)
    with manager.scope(48, torch.tensor(2), 4), pytest.raises(ValueError, match="multiple of 32"):
        Keep.apply(s)


def test_scale_inverse_is_paged_with_rows_over_32() -> None:
    manager = PagedStashManager(page_size=2, skip_immediate_backward=False)
    for step in range(2):
        manager.reset()
        s = torch.randn(4, 3, requires_grad=True)  # 128 tokens -> 4 scale rows
        mark_grouped_tensor(s, scale_inv=True)
        Keep.seen.clear()
        with manager.scope(128, torch.tensor(70), 64):
            out = Keep.apply(s)
        out.sum().backward()
        assert torch.equal(Keep.seen[0][:3], s.detach()[:3]) and not Keep.seen[0][3:].any()
        assert manager.stats().bytes_stashed == 3 * 3 * 4, step
    assert manager.stats().capture_peak_balanced_rows == {"float32x3": 2}


def test_key_not_seen_in_capture_is_a_lifecycle_error() -> None:
    manager = PagedStashManager(page_size=4, skip_immediate_backward=False)
    run_model(manager, 0)
    manager.reset()
    t = torch.randn(8, 5, requires_grad=True)
    mark_grouped_tensor(t)
    with manager.scope(8, torch.tensor(2), 4), pytest.raises(RuntimeError, match="capture"):
        Keep.apply(t)


def test_scopes_do_not_nest_and_reset_outside_scope_only() -> None:
    manager = PagedStashManager(page_size=4, skip_immediate_backward=False)
    with manager.scope(8, torch.tensor(2), 4):
        with pytest.raises(RuntimeError, match="nest"), manager.scope(8, torch.tensor(2), 4):
            pass
        with pytest.raises(RuntimeError, match="inside an open scope"):
            manager.reset()


def test_scope_validates_its_arguments() -> None:
    manager = PagedStashManager(page_size=4, skip_immediate_backward=False)
    with pytest.raises(TypeError, match="one-element integer tensor"), manager.scope(8, 3, 4):
        pass
    bad = torch.tensor(2.0)
    with pytest.raises(TypeError, match="integer tensor"), manager.scope(8, bad, 4):
        pass
    n = torch.tensor(2)
    for args, error, match in (
        ((8.0, n, 4), TypeError, "max_num_tokens must be an int"),
        ((0, n, 4), ValueError, "max_num_tokens must be >= 1"),
        ((8, n, -1), ValueError, "avg_num_tokens must be >= 0"),
        ((8, n, 4.5), TypeError, "avg_num_tokens must be an int"),
    ):
        with pytest.raises(error, match=match), manager.scope(*args):
            pass


def test_too_small_pool_overflows_without_crashing() -> None:
    manager = PagedStashManager(
        page_size=8, buffer_size_factor_cuda=0.2, skip_immediate_backward=False
    )
    run_model(manager, 0)
    manager.reset()
    run_model(manager, 1)  # runs to the end; results are invalid and flagged
    stats = manager.stats()
    assert stats.overflow and stats.stashes == stats.pops == 3


def test_host_tier_takes_what_the_device_pool_cannot() -> None:
    manager = PagedStashManager(
        page_size=8,
        buffer_size_factor_cuda=0.2,
        buffer_size_factor_cpu=2,
        skip_immediate_backward=False,
    )
    run_model(manager, 0)
    for step in (1, 2):
        manager.reset()
        on, off = run_model(manager, step), run_model(None, step)
        assert all(torch.equal(a, b) for a, b in zip(on, off))
        stats = manager.stats()
        assert stats.host_spill and not stats.overflow and stats.tensors_spilled >= 1


@pytest.mark.parametrize("num_tokens", [9, -1])
def test_counts_the_buffer_cannot_hold_are_invalid_in_both_modes(num_tokens: int) -> None:
    manager = PagedStashManager(page_size=4, skip_immediate_backward=False)
    for _ in range(2):  # the capture step, then the kernels
        manager.reset()
        t = torch.randn(8, 2, requires_grad=True)
        mark_grouped_tensor(t)
        with manager.scope(8, torch.tensor(num_tokens), 4):
            out = Keep.apply(t)
        out.sum().backward()
        stats = manager.stats()
        assert stats.invalid and not stats.overflow


@pytest.mark.parametrize("skip_immediate_backward", [True, False])
def test_a_kept_scope_checks_its_count_on_the_device_as_a_paged_one_does(
    skip_immediate_backward,
) -> None:
    # Before: with skip_immediate_backward (the default) the kept scope never reached the stash
    # kernels, so 20 tokens for a 16-row buffer passed unflagged there and were flagged in any
    # other layer. The check reads nothing on the host (the paged scope's reference kernels on
    # CPU do, by design: they are not the CUDA path).
    from tests.host_reads import NoHostReads

    manager = PagedStashManager(page_size=4, buffer_size_factor_cuda=2.0,
                                skip_immediate_backward=skip_immediate_backward)  # fmt: skip
    for step, n in enumerate([8, 8, 20, -1, 16]):
        manager.reset()
        t = torch.randn(16, 2, requires_grad=True)
        mark_grouped_tensor(t)
        kept = skip_immediate_backward and step > 0  # step 0 captures
        with NoHostReads() if kept else contextlib.nullcontext():
            with manager.scope(16, torch.tensor(n), 8):
                out = Keep.apply(t)
        out.sum().backward()
        stats = manager.stats()
        assert stats.stashes_skipped == kept
        assert stats.invalid == (n < 0 or n > 16) and not stats.overflow, (step, n)


def test_a_scope_that_saves_no_marked_tensor_still_checks_its_count() -> None:
    # The contract: every scope's count is checked, whatever it saves. A layer whose producers
    # mark nothing (or save nothing) never reaches the copy kernels, which check the others;
    # before, 20 tokens for a 16-row buffer passed unflagged there. On the device, no read.
    from tests.host_reads import NoHostReads

    manager = PagedStashManager(page_size=4, skip_immediate_backward=False)
    for step, n in enumerate([8, 8, 20, -1, 16]):
        manager.reset()
        t = torch.randn(16, 2, requires_grad=True)  # not marked
        with NoHostReads() if step else contextlib.nullcontext():
            with manager.scope(16, torch.tensor(n), 8):
                out = Keep.apply(t)
        out.sum().backward()
        stats = manager.stats()
        assert stats.stashes == 0
        assert stats.invalid == (n < 0 or n > 16), f"step {step}: a count of {n} unflagged"


def test_the_runner_refuses_a_step_whose_kept_scope_saw_an_impossible_count() -> None:
    from te_paged import PagedStashRunner
    from te_paged.runtime import InvalidCountsError

    manager = PagedStashManager(page_size=4, buffer_size_factor_cuda=2.0)  # keeps the last scope
    runner = PagedStashRunner(torch.nn.Linear(2, 2), manager)

    def step(counts):
        def fn():
            h = torch.randn(16, 2, requires_grad=True)
            for layer, n in enumerate(counts, 1):
                mark_grouped_tensor(h)
                with manager.scope(16, torch.tensor(n), 8, layer=layer):
                    h = Keep.apply(h)
            h.sum().backward()

        return fn

    runner.step(step([8, 8]))  # the capture step: the second scope is immediate
    runner.step(step([8, 8]))
    assert manager.stats().stashes_skipped == 1
    with pytest.raises(InvalidCountsError, match="layer 2: num_tokens 20 for a buffer of 16"):
        runner.step(step([8, 20]))  # the kept layer's count


def test_disabled_manager_installs_no_hooks() -> None:
    manager = PagedStashManager(page_size=4, skip_immediate_backward=False)
    with manager.disabled():
        run_model(manager, 0)
    assert manager.stats().stashes == 0


def test_release_frees_pools_and_reset_reallocates() -> None:
    manager = PagedStashManager(page_size=8, skip_immediate_backward=False)
    run_model(manager, 0)
    manager.reset()
    assert manager.stats().pool_bytes > 0
    manager.release()
    assert manager.stats().pool_bytes == 0
    manager.reset()
    assert manager.stats().pool_bytes > 0
    run_model(manager, 1)
    assert not manager.stats().overflow


def test_from_config() -> None:
    cfg = MoEConfig(
        moe_paged_stash=True,
        moe_expert_rank_capacity_factor=1.5,
        moe_paged_stash_page_size=16,
        moe_paged_stash_buffer_size_factor_cpu=0.5,
    )
    m = PagedStashManager.from_config(cfg)
    assert (m.page_size, m.buffer_size_factor_cuda, m.buffer_size_factor_cpu) == (16, 1.1, 0.5)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"page_size": 0}, ValueError, "page_size must be >= 1, got 0"),
        ({"page_size": 64.0}, TypeError, "page_size must be an int, got 64.0"),
        ({"page_size": True}, TypeError, "page_size must be an int"),
        ({"buffer_size_factor_cuda": 0.0}, ValueError, "buffer_size_factor_cuda=0 leaves no "
         "device pages"),
        ({"buffer_size_factor_cpu": float("-inf")}, ValueError, "buffer_size_factor_cpu must be "
         "finite"),
        ({"buffer_size_factor_cuda": float("nan")}, ValueError, "finite"),
        ({"buffer_size_factor_cuda": "1.1"}, TypeError, "must be a number, got '1.1'"),
        ({"device": "cuda"}, ValueError, "CUDA is not available here; use device='cpu'"),
        ({"device": "nonsense"}, ValueError, "device='nonsense' is not a device"),
        ({"device": 3}, TypeError, "device must be a torch.device or a string"),
        ({"kernel_backend": "cuda"}, ValueError, "kernel_backend='cuda' is not one of 'auto', "
         "'torch', 'triton'"),
        ({"zero_padding": "yes"}, TypeError, "zero_padding must be True or False"),
    ],
)  # fmt: skip
def test_manager_rejects_bad_arguments(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        PagedStashManager(**kwargs)


def test_tensor_marked_by_transformer_engine_is_paged() -> None:
    manager = PagedStashManager(page_size=4, skip_immediate_backward=False)
    for _ in range(2):
        manager.reset()
        t = torch.randn(8, 3, requires_grad=True)
        t.grouped_tensor_scale_inv = False  # what TE's mark_grouped_tensor sets
        Keep.seen.clear()
        with manager.scope(8, torch.tensor(5), 4):
            out = Keep.apply(t)
        out.sum().backward()
        assert torch.equal(Keep.seen[0][:5], t.detach()[:5])
        assert manager.stats().stashes == 1


def _train_steps(manager: PagedStashManager, steps: int, reset: bool) -> None:
    w = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([w], lr=0.1)
    for step in range(steps):
        if reset:
            manager.reset()
        run_model(manager, step)
        (w * 1.0).sum().backward()
        optimizer.step()


@pytest.mark.parametrize("captured", [False, True])
def test_a_step_without_reset_warns_once(captured) -> None:
    # Never reset (capture mode for ever), or reset once after the capture step (the pool is
    # allocated, then later steps keep stale pages and flags).
    manager = PagedStashManager(page_size=8, skip_immediate_backward=False)
    if captured:
        run_model(manager, 0)
        manager.reset()
    state = "keeping the last step's pages" if captured else "still in capture mode"
    with pytest.warns(RuntimeWarning, match=f"reset\\(\\) was not called.*{state}") as caught:
        _train_steps(manager, 3, reset=False)
    assert len([w for w in caught if "reset()" in str(w.message)]) == 1


def test_steps_with_reset_do_not_warn() -> None:
    manager = PagedStashManager(page_size=8, skip_immediate_backward=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train_steps(manager, 3, reset=True)
        # Several microbatches of one step (no optimizer step between them) do not warn either.
        manager.reset()
        run_model(manager, 0)
        run_model(manager, 1)


def _forward(manager: PagedStashManager, step: int = 0):
    """One marked layer's forward inside a scope; returns the output (it holds the graph)."""
    torch.manual_seed(step)
    x = torch.randn(40, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    with manager.scope(40, torch.tensor(17), 20):
        return torch.tanh(MarkedLinear.apply(x, w))


@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("what", ["reset", "release"])
def test_backward_after_a_step_boundary_raises_instead_of_reading_reused_pages(captured, what):
    # Before: reset() between a forward and its backward let backward reload pages that the
    # next stash had overwritten, and the free list ended with more pages than the pool.
    manager = PagedStashManager(page_size=8, skip_immediate_backward=False)
    if captured:
        _forward(manager).sum().backward()
        manager.reset()
    stale = _forward(manager, 1)
    getattr(manager, what)()
    manager.reset()
    fresh = _forward(manager, 2)  # takes the pages the stale graph's tensor had
    with pytest.raises(RuntimeError, match=r"stashed before the last reset\(\)/release\(\)"):
        stale.sum().backward()
    fresh.sum().backward()  # the pool is intact: the new step completes
    stats = manager.stats()
    assert stats.pops == stats.stashes == 1 and not stats.overflow and not stats.invalid
    if manager.buffers:
        (buf,) = manager.buffers.values()
        state = buf.state.tolist()
        assert state[1] - state[0] == buf.num_pages  # every page free exactly once


def test_a_graph_dropped_without_backward_does_not_block_reset() -> None:
    manager = PagedStashManager(page_size=8, skip_immediate_backward=False)
    _forward(manager).sum().backward()
    manager.reset()
    _forward(manager, 1)  # e.g. an evaluation forward with grad on: the graph dies here
    manager.reset()
    assert manager.stats().stashes == 0


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("f32x4", 4, 2, "cpu"), TypeError, "key must be a StashKey"),
        ((StashKey(torch.float32, 0), 4, 2, "cpu"), ValueError, "key.hidden must be >= 1"),
        ((StashKey(torch.bool, 4), 4, 2, "cpu"), TypeError, "cannot store tensors of dtype"),
        ((StashKey(torch.float32, 4), 0, 2, "cpu"), ValueError, "num_pages must be >= 1"),
        ((StashKey(torch.float32, 4), 4, 2.0, "cpu"), TypeError, "page_size must be an int"),
        ((StashKey(torch.float32, 4), 4, 2, "cuda"), ValueError, "CUDA is not available"),
    ],
)
def test_buffer_rejects_bad_arguments(args, error, match) -> None:
    with pytest.raises(error, match=match):
        PagedStashBuffer(*args)


def test_a_page_larger_than_every_saved_tensor_warns_at_allocation() -> None:
    # 40-row buffers in pages of 2**20 rows: each tensor fills 0.0038 % of its page.
    manager = PagedStashManager(page_size=2**20, buffer_size_factor_cuda=1.0)
    run_model(manager, 0)
    with pytest.warns(UserWarning, match=r"page_size=1048576 rows, but no saved tensor has more "
                      r"than 40 rows: each takes a whole page and fills at most "
                      r"0.0038% of it"):  # fmt: skip
        manager.reset()
    # the usual page of 64 rows, a little over the buffers: said as it is, 62 % (40 / 64)
    near = PagedStashManager(
        page_size=64, buffer_size_factor_cuda=1.0, skip_immediate_backward=False
    )
    run_model(near, 0)
    with pytest.warns(UserWarning, match=r"than 40 rows: each takes a whole page and fills at "
                      r"most 62% of it"):  # fmt: skip
        near.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manager.reset()  # once, at the first allocation
        fine = PagedStashManager(page_size=8, skip_immediate_backward=False)
        run_model(fine, 0)
        fine.reset()


def test_absurd_page_sizes_are_refused_naming_page_size(monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"page_size=1099511627776 rows: a page holds at most"):
        PagedStashManager(page_size=2**40)
    manager = PagedStashManager(page_size=2**30, buffer_size_factor_cuda=1.0)
    run_model(manager, 0)

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(torch, "zeros", no_memory)  # what a 2**30-row pool meets
    with (
        warnings.catch_warnings(),
        pytest.raises(RuntimeError, match=r"could not allocate the float32x16 pool: \d+ device "
                      r"\(\+ 0 host\) pages x page_size=1073741824 rows x 64 bytes a row"),
    ):  # fmt: skip
        warnings.simplefilter("ignore")
        manager.reset()
