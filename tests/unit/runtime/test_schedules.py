"""The pipeline-schedule simulator against Megatron-core 0.16's own tables and warmup counts, the
1F1B closed form, hand-worked orders, and a run of every stage together (no deadlock)."""

from __future__ import annotations

import itertools
import types

import pytest

from te_paged.runtime.schedules import (
    InFlight,
    Pass,
    PipelineConfig,
    PipelineSchedule,
    in_flight,
    pass_order,
    schedule_table,
    warmup_passes,
)


def _order(pipeline: PipelineConfig, rank: int) -> str:
    return " ".join(map(str, pass_order(pipeline, rank)))


def _valid_interleaved() -> list[tuple[int, int, int, int | None]]:
    """``(P, V, M, G)`` layouts Megatron-core accepts, small enough to simulate by the dozen."""
    cases = []
    for p, v, m in itertools.product((2, 3, 4), (1, 2, 3), range(1, 13)):
        for g in (None, p + 1, p + 2):  # None: G = P, the default
            try:
                PipelineConfig(p, m, v, g)
            except ValueError:
                continue
            cases.append((p, v, m, g))
    return cases


VALID_INTERLEAVED = _valid_interleaved()


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 5, 8, 13])
def test_1f1b_peak_is_min_of_stages_less_rank_and_microbatches(stages, microbatches) -> None:
    pipeline = PipelineConfig(stages, microbatches)
    for rank in range(stages):
        expected = 1 if stages == 1 else min(stages - rank, microbatches)
        # The last stage runs F(m) B(m): every forward's own backward comes next (immediate);
        # an earlier stage's forwards are followed by another microbatch's backward, unless
        # there is only one microbatch.
        immediate = rank == stages - 1 or microbatches == 1
        peaks = (expected, 0) if immediate else (0, expected)
        flight = in_flight(pipeline, rank)
        assert flight == InFlight(expected, (expected,), *peaks), (rank, pipeline)
        assert flight.pooled_layers(3, True) == 3 * expected - immediate
        order = pass_order(pipeline, rank)
        assert [p.microbatch for p in order if p.forward] == list(range(microbatches))
        assert [p.microbatch for p in order if not p.forward] == list(range(microbatches))


def test_hand_worked_1f1b() -> None:
    # 4 stages, 6 microbatches: stage 1 warms up with 2 forwards, then alternates.
    pipeline = PipelineConfig(4, 6)
    assert pipeline.schedule is PipelineSchedule.ONE_F_ONE_B
    assert _order(pipeline, 1) == (
        "F(0,c0) F(1,c0) F(2,c0) B(0,c0) F(3,c0) B(1,c0) F(4,c0) B(2,c0) F(5,c0) B(3,c0) "
        "B(4,c0) B(5,c0)"
    )
    assert _order(pipeline, 3) == " ".join(f"F({i},c0) B({i},c0)" for i in range(6))
    # No pipelining: forward and backward of each microbatch in turn, whatever M.
    assert _order(PipelineConfig(1, 3), 0) == "F(0,c0) B(0,c0) F(1,c0) B(1,c0) F(2,c0) B(2,c0)"


def test_hand_worked_interleaved() -> None:
    # The module docstring's example: P 2, V 2, M 4 (G = P = 2).
    pipeline = PipelineConfig(2, 4, virtual_stages=2)
    assert _order(pipeline, 0) == (
        "F(0,c0) F(1,c0) F(0,c1) F(1,c1) F(2,c0) B(0,c1) F(3,c0) B(1,c1) F(2,c1) B(0,c0) "
        "F(3,c1) B(1,c0) B(2,c1) B(3,c1) B(2,c0) B(3,c0)"
    )
    assert in_flight(pipeline, 0) == InFlight(5, (4, 2), 0, 5)  # no forward's backward is next
    assert _order(pipeline, 1) == (
        "F(0,c0) F(1,c0) F(0,c1) B(0,c1) F(1,c1) B(1,c1) F(2,c0) B(0,c0) F(3,c0) B(1,c0) "
        "F(2,c1) B(2,c1) F(3,c1) B(3,c1) B(2,c0) B(3,c0)"
    )
    # F(0,c1) B(0,c1) and F(1,c1) B(1,c1) are immediate at 3 in flight; F(2,c0) is not, at 3
    assert in_flight(pipeline, 1) == InFlight(3, (3, 1), 3, 3)
    assert in_flight(pipeline, 1).pooled_layers(2, True) == 6  # a kept layer does not lower it
    # ModelParallelConfig's docstring: PP 2, VP 2, group 3, M 5 runs microbatches
    # "0 1 2 0 1 2 3 4 3 4" (chunks 0 0 0 1 1 1 0 0 1 1).
    table = schedule_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    # One virtual stage is still Megatron's interleaved function: twice 1F1B's warmup.
    one = PipelineConfig(2, 4, virtual_stages=1)
    assert one.schedule is PipelineSchedule.INTERLEAVED
    assert [in_flight(one, r).peak for r in range(2)] == [3, 1]
    assert [in_flight(PipelineConfig(2, 4), r).peak for r in range(2)] == [2, 1]


@pytest.mark.parametrize(("p", "v", "m", "g"), VALID_INTERLEAVED)
def test_interleaved_peak_is_warmup_plus_one(p, v, m, g) -> None:
    pipeline = PipelineConfig(p, m, v, g)
    total = m * v
    for rank in range(p):
        warmup = min(2 * (p - rank - 1) + (v - 1) * pipeline.group_size, total)
        assert warmup_passes(pipeline, rank) == warmup
        flight = in_flight(pipeline, rank)
        assert flight.peak == min(warmup + 1, total), (rank, pipeline)
        assert len(flight.chunk_peaks) == v and max(flight.chunk_peaks) <= m
        assert sum(flight.chunk_peaks) >= flight.peak


def _megatron_schedules():
    pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 (the Megatron extra)")
    from megatron.core.pipeline_parallel import schedules

    return schedules


def _communicator(p: int, rank: int, v: int | None):
    """What ``get_pp_rank_microbatches`` reads of a P2PCommunicator: no process group needed."""
    group = types.SimpleNamespace(size=lambda: p, rank=lambda: rank)
    return types.SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=v)


@pytest.mark.parametrize(("p", "v", "m", "g"), VALID_INTERLEAVED)
def test_interleaved_matches_megatrons_table_and_warmup(p, v, m, g) -> None:
    schedules = _megatron_schedules()
    pipeline = PipelineConfig(p, m, v, g)
    group = pipeline.group_size
    assert schedule_table(m, v, group) == schedules.get_schedule_table(m, v, group)
    for rank in range(p):
        total, all_warmup, warmup, remaining = schedules.get_pp_rank_microbatches(
            m, v, group, p2p_communicator=_communicator(p, rank, v)
        )
        assert (total, warmup, remaining) == (m * v, warmup_passes(pipeline, rank), total - warmup)
        assert in_flight(pipeline, rank).peak == (total if all_warmup else warmup + 1)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 16])
def test_1f1b_matches_megatrons_warmup(p, m) -> None:
    schedules = _megatron_schedules()
    pipeline = PipelineConfig(p, m)
    for rank in range(p):
        _, _, warmup, _ = schedules.get_pp_rank_microbatches(
            m, 1, p, p2p_communicator=_communicator(p, rank, None)
        )
        # forward_backward_pipelining_without_interleaving computes it itself: min(P - r - 1, M)
        assert warmup == warmup_passes(pipeline, rank) == min(p - rank - 1, m)
        assert in_flight(pipeline, rank).peak == min(warmup + 1, m)


def _run_every_stage(pipeline: PipelineConfig, orders: list[list[Pass]] | None = None) -> int:
    """Run all stages' orders together, each pass once what it consumes exists: a forward needs
    the previous stage's forward of the same (microbatch, chunk) — on stage 0, the last stage's
    forward of the chunk before; a backward the next stage's backward, mirrored likewise. Returns
    the rounds taken; fails on a deadlock (no stage can move)."""
    p, v = pipeline.pipeline_parallel, pipeline.chunks
    orders = orders or [pass_order(pipeline, r) for r in range(p)]
    done: set[tuple[int, Pass]] = set()
    nxt = [0] * p

    def ready(rank: int, pas: Pass) -> bool:
        mb, c = pas.microbatch, pas.chunk
        if pas.forward:
            if rank > 0:
                return (rank - 1, Pass(True, mb, c)) in done
            return c == 0 or (p - 1, Pass(True, mb, c - 1)) in done
        if (rank, Pass(True, mb, c)) not in done:
            return False
        if rank < p - 1:
            return (rank + 1, Pass(False, mb, c)) in done
        return c == v - 1 or (0, Pass(False, mb, c + 1)) in done

    rounds = 0
    while any(n < len(o) for n, o in zip(nxt, orders)):
        moved = [r for r in range(p) if nxt[r] < len(orders[r]) and ready(r, orders[r][nxt[r]])]
        assert moved, f"deadlock at {[o[n] if n < len(o) else None for n, o in zip(nxt, orders)]}"
        for r in moved:
            done.add((r, orders[r][nxt[r]]))
            nxt[r] += 1
        rounds += 1
    return rounds


@pytest.mark.parametrize(
    ("p", "v", "m", "g"),
    [(p, None, m, None) for p in (2, 3, 4) for m in (1, 2, 5, 8)]
    + [c for c in VALID_INTERLEAVED if c[2] <= 8],
)
def test_every_stage_together_runs_to_the_end(p, v, m, g) -> None:
    pipeline = PipelineConfig(p, m, v, g)
    assert _run_every_stage(pipeline) >= 2 * m * pipeline.chunks


def test_the_run_of_every_stage_catches_a_wrong_order() -> None:
    # The last stage running its passes backwards (backward before forward) cannot run.
    pipeline = PipelineConfig(2, 2)
    orders = [pass_order(pipeline, 0), pass_order(pipeline, 1)[::-1]]
    with pytest.raises(AssertionError, match="deadlock"):
        _run_every_stage(pipeline, orders)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"pipeline_parallel": 0, "microbatches": 1}, "pipeline_parallel must be an int >= 1"),
        ({"pipeline_parallel": 2, "microbatches": 0}, "microbatches must be an int >= 1"),
        ({"pipeline_parallel": 2, "microbatches": 2, "virtual_stages": 0}, "virtual_stages must"),
        ({"pipeline_parallel": 1, "microbatches": 4, "virtual_stages": 2}, "no_pipelining"),
        ({"pipeline_parallel": 2, "microbatches": 4, "microbatch_group_size": 2}, "interleaved"),
        ({"pipeline_parallel": 4, "microbatches": 3, "virtual_stages": 2}, r"<= microbatches \(3"),
        ({"pipeline_parallel": 4, "microbatches": 6, "virtual_stages": 2}, "remainder is 2"),
        (
            {
                "pipeline_parallel": 2,
                "microbatches": 4,
                "virtual_stages": 2,
                "microbatch_group_size": 5,
            },
            r"group size \(5\)",
        ),
    ],
)
def test_layouts_megatron_refuses_are_refused(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**kw)


def test_megatron_accepts_a_remainder_of_at_least_the_pipeline_size() -> None:
    # G 3 > P 2, M 5: the last group has 2 >= P microbatches, which Megatron-core allows.
    pipeline = PipelineConfig(2, 5, virtual_stages=2, microbatch_group_size=3)
    assert [in_flight(pipeline, r).peak for r in range(2)] == [min(2 + 3 + 1, 10), 3 + 1]
    assert pipeline.check_layers(8) == 2
    with pytest.raises(ValueError, match="multiple of pipeline_parallel × model chunks"):
        pipeline.check_layers(6)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        in_flight(pipeline, 2)
