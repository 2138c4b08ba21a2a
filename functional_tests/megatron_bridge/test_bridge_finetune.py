"""te_paged inside Megatron-Bridge's ``finetune()`` (0.6.2): supervised fine-tuning whose
microbatches change their token count from step to step and from rank to rank, on 4 gloo
ranks (``finetune_worker.py``; Bridge's SFT batches unpacked, see its docstring).
"""

from __future__ import annotations

import pytest

from functional_tests.megatron_bridge import bridge_launch
from functional_tests.megatron_bridge.finetune_worker import STEPS

LAUNCH = bridge_launch("finetune_worker", timeout_s=150)
LAUNCHES = [LAUNCH]
#: The records of a run: 6 iterations, an evaluation after every second, the last validation.
TRAINING = [0, 1, 3, 4, 6, 7]


@pytest.fixture(scope="module")
def ranks(launches) -> list[dict]:
    return launches.result(LAUNCH)


def _tokens(result: dict, run: str) -> list[list[int]]:
    """Per training step, the rank's microbatches' token counts."""
    tokens = result["runs"][run]["tokens"]
    return [tokens[i] for i in TRAINING]


def test_the_microbatches_token_counts_vary_across_steps_and_ranks(ranks) -> None:
    for run in ("ft_on", "ft_declared"):
        per_rank = [_tokens(result, run) for result in ranks]
        assert all(len({n for step in steps for n in step}) >= 2 for steps in per_rank), run
        assert any(len({steps[i][0] for steps in per_rank}) > 1 for i in range(STEPS)), run
        assert max(n for steps in per_rank for step in steps for n in step) <= 2 * 64


@pytest.mark.parametrize("run", ["ft_on", "ft_declared"])
def test_finetune_on_equals_off_bitwise(ranks, run) -> None:
    for rank, result in enumerate(ranks):
        assert result["equal"][run] == [True] * STEPS, (rank, run, result["equal"][run])
        assert [result["runs"][run]["enabled"][i] for i in TRAINING[:1]] == [True]  # captured


def test_undeclared_it_grows_at_most_once_per_new_largest_microbatch(ranks) -> None:
    """EP 1: a step reruns only where some rank's microbatch is larger than any it brought
    before (the pools then grow to it); every other step pages."""
    per_rank = [_tokens(result, "ft_on") for result in ranks]
    new_largest = [
        i
        for i in range(1, STEPS)
        if any(max(steps[i]) > max(max(s) for s in steps[:i]) for steps in per_rank)
    ]
    for result in ranks:
        run = result["runs"]["ft_on"]
        reran = [i for i, record in enumerate(TRAINING) if run["attempt"][record] == 2]
        assert set(reran) <= set(new_largest), (reran, new_largest, per_rank)
        assert run["fallbacks"] == len(reran) <= len(new_largest)
        assert all(run["flags"][TRAINING[i]][1] == 0 for i in reran)  # overflow, not budget
        pages = [i for i in range(1, STEPS) if i not in reran]
        assert all(run["enabled"][TRAINING[i]] for i in pages), run["enabled"]


def test_with_moe_max_tokens_per_rank_declared_nothing_reruns(ranks) -> None:
    """EP 4, ranks bringing different counts in one step: the capture step sized the pools and
    the exchange for the declared maximum, so every step pages at once."""
    for result in ranks:
        run = result["runs"]["ft_declared"]
        assert run["attempt"] == [1] * len(run["attempt"]) and run["fallbacks"] == 0, run
        assert [run["enabled"][i] for i in TRAINING] == [True] * STEPS, run["enabled"]
