"""The memory summary of ``te-paged ab`` over ranks (:meth:`ABResult.memory`): the lower median
of a stage's ranks, the highest stage, the largest pool, and the spread reported."""

from __future__ import annotations

import pytest

from te_paged.tools.ab_result import ABResult, RankResult, StepResult, format_table

MIB = 2**20
CONFIG = {"capacity_factor": 2.0, "buffer_factor_cuda": 1.1, "layers": 4}


def _step(peak: int, *, capture: bool = False, pool: int = 0) -> StepResult:
    record = {"step": 0}
    return StepResult(1.0, 1.0, 1, True, 0, 0, 0, peak, record, capture, pool, 4 * MIB)


def _rank(rank: int, on_peak: int, off_peak: int, *, stage: int = 0, pool: int = 5 * MIB):
    on = [_step(0, capture=True), _step(on_peak, pool=pool)]
    off = [_step(0), _step(off_peak)]
    return RankResult(
        rank, on, off, [True, True], pool, 0, 4 * MIB, 10, 10, "test", [],
        memory_step=1, stage=stage,
    )  # fmt: skip


def _result(ranks: list[RankResult], **config) -> ABResult:
    return ABResult({**CONFIG, **config}, len(ranks), ranks)


def test_agreeing_ranks_give_their_peak_and_no_spread() -> None:
    m = _result([_rank(r, 20 * MIB, 30 * MIB) for r in range(4)]).memory()
    assert m["peak_on_bytes"] == 25 * MIB and m["peak_off_bytes"] == 30 * MIB
    assert m["saving_bytes"] == 5 * MIB
    assert m["peak_on_rank_spread_bytes"] == 0 and m["peak_off_rank_spread_bytes"] == 0


@pytest.mark.parametrize("late", [0, 3])
def test_one_rank_whose_peak_gained_a_collectives_buffers_is_set_aside(late: int) -> None:
    # What CI saw on the torchtitan engine: one of 4 ranks 358656 bytes higher, ON or OFF.
    extra = 358656
    on = [_rank(r, 20 * MIB + (extra if r == late else 0), 30 * MIB) for r in range(4)]
    off = [_rank(r, 20 * MIB, 30 * MIB + (extra if r == late else 0)) for r in range(4)]
    m_on, m_off = _result(on).memory(), _result(off).memory()
    assert m_on["saving_bytes"] == m_off["saving_bytes"] == 5 * MIB
    assert (m_on["peak_on_rank_spread_bytes"], m_on["peak_off_rank_spread_bytes"]) == (extra, 0)
    assert (m_off["peak_on_rank_spread_bytes"], m_off["peak_off_rank_spread_bytes"]) == (0, extra)
    table = format_table(_result(on))
    assert "lower median over 4 ranks" in table
    assert "disagreed on a peak by up to 0.34 MiB ON, 0.00 MiB OFF" in table
    agreeing = _result([_rank(r, 20 * MIB, 30 * MIB) for r in range(4)])
    assert "disagreed" not in format_table(agreeing)


def test_the_lower_median_is_not_the_lowest_rank() -> None:
    # Two ranks of four higher: the lower median is the higher of the two low ones, so a peak
    # the majority holds is never hidden by one low rank.
    peaks = [18 * MIB, 20 * MIB, 22 * MIB, 22 * MIB]
    m = _result([_rank(r, p, 30 * MIB) for r, p in enumerate(peaks)]).memory()
    assert m["peak_on_bytes"] == 20 * MIB + 5 * MIB
    assert m["peak_on_rank_spread_bytes"] == 4 * MIB


def test_the_largest_pool_and_the_highest_stage_count() -> None:
    ranks = [
        _rank(0, 20 * MIB, 30 * MIB, stage=0, pool=5 * MIB),
        _rank(1, 20 * MIB, 30 * MIB, stage=0, pool=6 * MIB),
        _rank(2, 24 * MIB, 31 * MIB, stage=1, pool=5 * MIB),
        _rank(3, 24 * MIB, 31 * MIB, stage=1, pool=5 * MIB),
    ]
    result = _result(ranks, pipeline_parallel=2, microbatches=2)
    m = result.memory()
    assert m["peak_on_bytes"] == 24 * MIB + 6 * MIB and m["peak_off_bytes"] == 31 * MIB
    assert m["peak_on_rank_spread_bytes"] == 0  # within each stage the ranks agree
    stage0, stage1 = result.memory_per_stage()
    assert stage0["peak_on_bytes"] == 26 * MIB and stage1["peak_on_bytes"] == 29 * MIB
    # Stage 0's two ranks disagree: the lower median of two is the lower one.
    ranks[0].on[1].peak_bytes = 21 * MIB
    assert result.memory(0)["peak_on_bytes"] == 26 * MIB
    assert result.memory(0)["peak_on_rank_spread_bytes"] == 1 * MIB


def test_one_rank_is_its_own_figure() -> None:
    m = _result([_rank(0, 20 * MIB, 30 * MIB)]).memory()
    assert m["peak_on_bytes"] == 25 * MIB and m["peak_on_rank_spread_bytes"] == 0
    assert "one rank" in format_table(_result([_rank(0, 20 * MIB, 30 * MIB)]))


def test_the_spread_reported_over_stages_is_the_largest_stages() -> None:
    # Stage 0's ranks disagree by 3 MiB ON, stage 1's by 1 MiB (and OFF the other way round):
    # the run's spread is the larger, the figure that says how far a rank may be off.
    ranks = [
        _rank(0, 20 * MIB, 30 * MIB, stage=0),
        _rank(1, 23 * MIB, 31 * MIB, stage=0),
        _rank(2, 24 * MIB, 30 * MIB, stage=1),
        _rank(3, 25 * MIB, 33 * MIB, stage=1),
    ]
    m = _result(ranks, pipeline_parallel=2, microbatches=2).memory()
    assert m["peak_on_rank_spread_bytes"] == 3 * MIB, "not the largest stage's ON spread"
    assert m["peak_off_rank_spread_bytes"] == 3 * MIB, "not the largest stage's OFF spread"
