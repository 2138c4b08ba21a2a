"""NVFP4 storage of saved inputs: the E2M1 grid and its rounding, the two scales, padding, and
paging the packed data and block scales through the stash (capture, pooled, host tier) and a
stash overflow rerun, bitwise."""

from __future__ import annotations

import pytest
import torch

from te_paged.grouped.fp8 import (
    FP4_E2M1_MAX,
    FP8_E4M3_MAX,
    NVFP4_BLOCK,
    Fp8Recipe,
    Fp8Tensor,
    dequantize,
    mark_fp8_saved,
    quantize,
)
from te_paged.stash import PagedStashManager, StashKey, StashMode
from tests.host_reads import NoHostReads

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _sample(rows: int, hidden: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=g) * 3


def _unpack(data: torch.Tensor) -> torch.Tensor:
    """E2M1 codes, two per byte, element 2i in the low nibble."""
    return torch.stack((data & 15, data >> 4), dim=-1).view(data.shape[0], -1)


def test_grid_values_are_exact_and_ties_go_to_the_even_code() -> None:
    # One block holding the grid at full scale: global scale 448·6/6, block scale e4m3(448) = 448,
    # so every element is encoded as its own code (back to within float32's rounding of 1/448).
    x = torch.tensor([GRID + [-v for v in GRID]])
    fp8 = quantize(x, "nvfp4")
    assert _unpack(fp8.data).tolist() == [[*range(8), 0, *range(9, 16)]]  # -0.0 stores +0
    torch.testing.assert_close(dequantize(fp8), x, rtol=2**-20, atol=0)
    # Midpoints between grid values round to the even code (0, 1.0, 1.0, 2, 2, 4, 4), as
    # torch.round does.
    mids = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2]) * torch.tensor(
        [[1.0] * 8 + [-1.0] * 8]
    )
    full = torch.cat([torch.full((1, 16), 6.0), mids])  # row 0 fixes the global scale at 6
    codes = _unpack(quantize(full, "nvfp4").data)[1]
    want = [0, 2, 2, 4, 4, 6, 6, 7]  # the codes of 0, 1, 1, 2, 2, 4, 4, 6
    assert codes.tolist() == want + [c | 8 if c else 0 for c in want]


def test_layout_scales_and_error_bound() -> None:
    x = _sample(40, 64)
    fp8 = quantize(x, Fp8Recipe.NVFP4)
    assert (fp8.data.dtype, tuple(fp8.data.shape)) == (torch.uint8, (40, 32))
    assert (fp8.scale_inv.dtype, tuple(fp8.scale_inv.shape)) == (torch.float8_e4m3fn, (40, 4))
    assert fp8.global_scale_inv.shape == (1,)
    torch.testing.assert_close(
        fp8.global_scale_inv[0], x.abs().max() / (FP8_E4M3_MAX * FP4_E2M1_MAX)
    )
    # 4.5 bits an element: 32 + 4 bytes a row of 64.
    assert fp8.data.numel() + fp8.scale_inv.numel() == 40 * 64 * 4.5 / 8
    deq = dequantize(fp8)
    # Half the largest E2M1 step (1 of the block's 6 units) plus e4m3's 2^-4 on the block scale.
    amax_RB = x.view(40, 4, NVFP4_BLOCK).abs().amax(-1, keepdim=True)
    err = (deq - x).view(40, 4, NVFP4_BLOCK).abs()
    assert bool((err <= amax_RB / FP4_E2M1_MAX * (1 + 2**-4) + amax_RB * 2**-4).all())
    assert float((deq - x).abs().mean() / x.abs().mean()) < 0.1


def test_padding_rows_are_zero_bytes_and_do_not_change_the_scales() -> None:
    n = 29
    x = _sample(48, 32)
    clean = x.clone()
    clean[n:] = 0
    x[n:] = float("nan")
    fp8 = quantize(x, "nvfp4", num_rows=torch.tensor(n))
    ref = quantize(clean, "nvfp4")
    assert torch.equal(fp8.data, ref.data) and not bool(fp8.data[n:].any())
    assert torch.equal(fp8.scale_inv.view(torch.uint8), ref.scale_inv.view(torch.uint8))
    assert not bool(fp8.scale_inv[n:].view(torch.uint8).any())
    assert torch.equal(fp8.global_scale_inv, ref.global_scale_inv)
    zeros = quantize(torch.zeros(4, 16), "nvfp4")
    assert torch.equal(zeros.global_scale_inv, torch.ones(1)) and not bool(dequantize(zeros).any())


def test_quantize_reads_nothing_on_the_host() -> None:
    x, n = _sample(64, 32), torch.tensor(40)
    with NoHostReads():
        dequantize(quantize(x, "nvfp4", num_rows=n))


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize(torch.zeros(4, 24), "nvfp4")
    fp8 = quantize(torch.zeros(4, 32), "nvfp4")
    with pytest.raises(ValueError, match="does not match"):
        dequantize(Fp8Tensor(fp8.data, fp8.scale_inv[:, :1], fp8.recipe, fp8.dtype, None))


class _SaveNvfp4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, num_rows, sink):
        fp8 = quantize(x, "nvfp4", num_rows)
        mark_fp8_saved(fp8)
        ctx.save_for_backward(*fp8.saved())
        ctx.sink = sink
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        ctx.sink.append(Fp8Tensor.from_saved(ctx.saved_tensors, Fp8Recipe.NVFP4, dy.dtype)[0])
        return dy, None, None


@pytest.mark.parametrize("host_tier", [False, True], ids=["device", "host-tier"])
def test_packed_data_and_block_scales_page_bitwise(host_tier) -> None:
    max_tokens, n, hidden = 64, 40, 64
    x = _sample(max_tokens, hidden)
    x[n:] = 7.0
    num_tokens = torch.tensor([n])
    ref = quantize(x, "nvfp4", num_tokens)
    # With the host tier, a device pool of one page spills the rest to the host.
    factors = (
        {"buffer_size_factor_cuda": -0.01, "buffer_size_factor_cpu": -2.0} if host_tier else {}
    )
    manager = PagedStashManager(page_size=16, skip_immediate_backward=False, **factors)
    for _step in range(3):  # capture step, then pooled steps
        manager.reset()
        sink: list[Fp8Tensor] = []
        xs = x.clone().requires_grad_()
        with manager.scope(max_tokens, num_tokens, n):
            y = _SaveNvfp4.apply(xs, num_tokens, sink)
        y.sum().backward()
        (got,) = sink
        assert torch.equal(got.data, ref.data)
        assert torch.equal(got.scale_inv.view(torch.uint8), ref.scale_inv.view(torch.uint8))
        assert torch.equal(dequantize(got), dequantize(ref))
        stats = manager.stats()
        assert stats.stashes == stats.pops == 2 and not stats.overflow  # global scale: static
        # 40 rows of 32 data bytes and 4 scale bytes: 4.5 bits an element.
        assert stats.bytes_stashed == n * (hidden // 2 + hidden // 16)
    assert stats.mode is StashMode.CAPTURED
    assert stats.tensors_spilled > 0 if host_tier else stats.tensors_spilled == 0
    keys = {StashKey(torch.uint8, hidden // 2), StashKey(torch.float8_e4m3fn, hidden // 16)}
    assert set(manager.buffers) == keys


def test_a_stash_overflow_is_rerun_bitwise() -> None:
    from te_paged.runtime import PagedStashRunner
    from te_paged.tools.model import ModelConfig, ToyMoEModel, make_batch

    cfg = ModelConfig(layers=2, experts=4, topk=2, hidden=32, ffn=32, tokens=32, page_size=4,
                      fp8="nvfp4", buffer_factor_cuda=0.3, grow_pool=False)  # fmt: skip

    def train(paged):
        torch.manual_seed(0)
        model = ToyMoEModel(cfg, paged=paged, group=None)
        runner = PagedStashRunner(model, model.manager, max_consecutive_fallbacks=3,
                                  grow_pool=False) if paged else None  # fmt: skip
        out = []
        for step in range(3):
            x, target = make_batch(cfg, step, 0)
            model.zero_grad(set_to_none=True)

            def fn(x=x, target=target):
                loss = model(x, target)
                loss.backward()
                return loss

            loss, record = runner.step(fn) if runner else (fn(), None)
            out.append((loss, [p.grad.clone() for p in model.parameters()], record))
        return out

    on, off = train(True), train(False)
    assert [r.attempt for _, _, r in on] == [1, 2, 2]  # a pool of 0.3 x the balanced case
    assert all(r.stash_overflow_ranks for _, _, r in on[1:])
    for (a, ga, _), (b, gb, _) in zip(on, off):
        assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))
