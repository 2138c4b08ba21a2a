"""te_paged inside Megatron-Bridge's own training loop: ``megatron.bridge.training.pretrain``'s
``pretrain()`` (0.6.2, on megatron-core 0.19.2) with the paged-stash fields Bridge's perf
recipes set, on 4 gloo ranks.

The launch runs every ``pretrain()`` of ``pretrain_worker.py`` (see its docstring); the tests
read its per-rank JSON. "Equal" is bitwise per iteration: the loss, the grad norm and every
parameter after the optimizer step. Megatron's own ``PagedStashRunner`` (which Bridge builds
whenever ``moe_expert_rank_capacity_factor`` is set) drives te_paged's layers through
:class:`~te_paged.integrations.megatron.MegatronLoopAdapter`.
"""

from __future__ import annotations

import pytest

from functional_tests.megatron_bridge import bridge_launch
from functional_tests.megatron_bridge.pretrain_worker import STEPS

LAUNCH = bridge_launch("pretrain_worker", timeout_s=300, own_launch=True)
LAUNCHES = [LAUNCH]
#: The records of a 3-iteration run: iterations 1 and 2, the evaluation at 2, iteration 3, the
#: last validation and test evaluations; of a 2-iteration (pipeline) run: 1, 2, the evaluation,
#: the last two.
TRAINING, EVALUATIONS = [0, 1, 3], [2, 4, 5]
PIPELINE_TRAINING = [0, 1]


@pytest.fixture(scope="module")
def ranks(launches) -> list[dict]:
    return launches.result(LAUNCH)


def _run(result: dict, name: str) -> dict:
    return result["runs"][name]


@pytest.mark.parametrize("pair", ["on", "pp2", "vpp"])
def test_pretrain_on_equals_off_bitwise_with_dropout(ranks, pair) -> None:
    """EP 4; pipeline parallel 2 with 1F1B, and with 2 virtual stages (EP 2): paged stash ON
    equals OFF, every iteration and evaluation, te_paged paging every training step."""
    on = {"on": "on", "pp2": "pp2_on", "vpp": "vpp_on"}[pair]
    training = TRAINING if pair == "on" else PIPELINE_TRAINING
    for rank, result in enumerate(ranks):
        steps = STEPS if pair == "on" else len(PIPELINE_TRAINING)
        assert result["equal"][pair] == [True] * steps, (rank, pair, result["equal"][pair])
        assert result["eval_equal"][pair], (rank, pair)
        run = _run(result, on)
        assert run["attempt"] == [1] * len(run["attempt"]), run["attempt"]  # no rerun
        assert [run["enabled"][i] for i in training] == [True] * len(training), run["enabled"]
        for i, per_manager in enumerate(run["stashes_pops"]):
            for stashes, pops, kept in per_manager:
                assert stashes == pops and (stashes + kept > 0) == (i in training), run
        assert run["loops"] == 1  # one adapter for every layer (and every virtual stage)


def test_every_form_of_the_providers_spec_builds_te_pageds_layers(ranks) -> None:
    """A function of the provider through with_te_paged_moe (on, pp2), gpt_layer_spec
    (overflow) and DeepSeek-V3's partial(get_gpt_decoder_block_spec, ...) (over_budget, vpp):
    each trained te_paged's layers (an adapter, records), and the runs equal off."""
    for result in ranks:
        for name in ("on", "overflow", "over_budget", "vpp_on", "pp2_on"):
            assert _run(result, name)["loops"] == 1, name


def test_forced_over_budget_reruns_every_step_bitwise_to_the_run_that_never_did(ranks) -> None:
    """Capacity factor 1.0: every training step and evaluation goes over budget and reruns,
    the step right after an evaluation (iteration 3) included; each equals ``off``."""
    for rank, result in enumerate(ranks):
        assert _run(result, "off")["attempt"] == [1] * 6  # never over budget: the reference
        run = _run(result, "over_budget")
        assert run["attempt"] == [2] * 6, run["attempt"]
        assert run["fallbacks"] == STEPS, run  # the evaluations' reruns are not fallbacks
        assert result["equal"]["over_budget"] == [True] * STEPS, (rank, result["equal"])
        assert result["eval_equal"]["over_budget"], rank


def test_forced_stash_overflow_reruns_bitwise(ranks) -> None:
    for rank, result in enumerate(ranks):
        run = _run(result, "overflow")  # a 0.3x pool, grow_pool off: each paged step overflows
        assert [run["attempt"][i] for i in TRAINING] == [1, 2, 2], run["attempt"]
        assert [run["attempt"][i] for i in EVALUATIONS] == [1, 1, 1], run["attempt"]
        assert run["fallbacks"] == 2, run
        assert result["equal"]["overflow"] == [True] * STEPS, (rank, result["equal"])


@pytest.mark.parametrize("saved", ["on", "overflow"])
def test_a_bridge_checkpoint_resumes_bitwise_and_the_stash_captures_again(ranks, saved) -> None:
    """Saved at iteration 2 (Bridge's torch_dist checkpoint, distributed optimizer), loaded by
    a new ``pretrain()``: iteration 3 equals the run that never stopped, ON and with a forced
    overflow. te_paged's pools are not in the checkpoint: the resumed run's first step is a
    capture step again (its stash kept), then it pages (or, 0.3x, overflows and reruns)."""
    resumed = {"on": "resume", "overflow": "overflow_resume"}[saved]
    for rank, result in enumerate(ranks):
        run = _run(result, resumed)
        assert len(run["loss"]) == 1, run
        assert result["equal"][resumed] == [True], (rank, result["equal"][resumed])
        assert run["eval_loss"] == _run(result, saved)["eval_loss"][1:], run
        assert run["attempt"][0] == 1 and run["enabled"][0], run  # the capture step
        assert run["log"][0].startswith("te_paged: iteration 3:") if rank == 0 else True


def test_inference_passes_between_steps_are_left_alone(ranks) -> None:
    """An RL framework's logprob passes (before training, after every step; eval mode, no
    autograd, 200 tokens a microbatch against training's 128): they page nothing, move no
    counter, pool or capture state, log nothing, count no fallback, and the training around
    them equals ``off`` (which ran none); ``on``'s records are those of a run without them."""
    for result in ranks:
        run = _run(result, "on")
        passes = run["passes"]
        assert len(passes["moved"]) == STEPS + 1 and passes["moved"] == [""] * (STEPS + 1), passes
        assert passes["said"] == [], passes
        assert run["fallbacks"] == 0 and run["attempt"] == [1] * 6
        assert [run["enabled"][i] for i in TRAINING] == [True] * STEPS  # no step taken for one
        assert result["equal"]["on"] == [True] * STEPS
    # The passes' outputs are the same on every rank of the data-parallel group (EP 4, DP 4:
    # the same batch everywhere): te_paged's dropless pass is exact whatever the routing.
    sums = [result["runs"]["on"]["passes"]["sums"] for result in ranks]
    assert all(len(s) == STEPS + 1 for s in sums) and sums[1:] == sums[:-1], sums


def test_the_fallbacks_and_pool_bytes_are_logged_under_bridge(ranks) -> None:
    """Bridge has no Megatron-LM global arguments: the adapter reads Bridge's state."""
    lines = _run(ranks[0], "overflow")["log"]
    assert [line.split(":")[1] for line in lines] == [" iteration 1", " iteration 2",
                                                       " iteration 3"], lines  # fmt: skip
    assert "0 fallback(s) in the last 1 iteration(s), 0 in all" in lines[0], lines
    assert "1 fallback(s) in the last 1 iteration(s), 2 in all" in lines[2], lines
    assert _run(ranks[0], "on")["log"][0].endswith("MiB on this rank")
    assert float(_run(ranks[0], "on")["log"][0].split("pools ")[1].split()[0]) > 0
    for other in ranks[1:]:  # rank 0 says it for the run
        assert _run(other, "overflow")["log"] == []


def test_megatrons_ddp_reduces_expert_gradients_over_the_expert_groups(ranks) -> None:
    """te_paged's expert weights carry Megatron's ``allreduce=False``: DDP puts them in its
    expert buffers (EP 4: 2 layers x 2 local experts x fc1, fc2), none in the dense buffers,
    whose reduction over all 4 data-parallel ranks would average different experts."""
    for result in ranks:
        assert _run(result, "on")["expert_params"] == {"buffers": 0,
                                                      "expert_parallel_buffers": 8}  # fmt: skip
