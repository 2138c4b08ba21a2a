"""``MegatronLoopAdapter``'s checks in one process: its options, the order of Megatron's
runner's calls it accepts, the two-runners refusal and the unchecked-step guard. (Driven by
Megatron's real runner on 4 ranks in functional_tests/megatron: test_megatron_builtin_stash.py
and test_megatron_pretrain.py.)"""

from __future__ import annotations

import pytest

from te_paged.integrations.megatron import MegatronLoopAdapter
from te_paged.integrations.megatron.loop import _Phase


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grow_headroom": 0.5}, "grow_headroom"),
        ({"max_consecutive_fallbacks": 0}, "max_consecutive_fallbacks"),
        ({"log_interval": 0}, "log_interval"),
        ({"max_pool_bytes": 0}, "max_pool_bytes"),
        ({"grow_pool": 1}, "grow_pool"),
        # Before: accepted, and failing inside Megatron's runner at the first record or rerun.
        ({"on_record": "log"}, "on_record must be a callable"),
        ({"restorables": None}, "restorables must be an iterable"),
        ({"restorables": [object()]}, "is not Restorable"),
    ],
)
def test_bad_options_are_refused_naming_them(kwargs, message) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        MegatronLoopAdapter(**kwargs)


def test_before_megatrons_runner_is_built_the_adapter_stays_out_of_the_way() -> None:
    adapter = MegatronLoopAdapter()
    # A forward of the user's own, no runner yet: nothing happens.
    adapter.on_forward(training=True, grad=True)
    assert adapter.phase is _Phase.UNREAD
    adapter.on_optimizer_step()  # nothing was checked, nothing expected to be
    with pytest.raises(RuntimeError, match="asks for a rerun, but te_paged's adapter is UNREAD"):
        adapter.prepare_rerun()
    with pytest.raises(RuntimeError, match="asks for a rerun"):
        adapter.set_capacity_factor(None)  # the same preparation, by the factor


def test_a_rerun_without_the_attempts_flags_read_is_refused() -> None:
    adapter = MegatronLoopAdapter()
    adapter.phase = _Phase.RUNNING  # an attempt ran; Megatron's runner never checked it
    with pytest.raises(RuntimeError, match="RUNNING"):
        adapter.prepare_rerun()
    adapter.phase = _Phase.RERUN  # the other layers' calls of one preparation: accepted
    adapter.prepare_rerun()
    adapter.set_capacity_factor(2.0)  # ...and a factor set back outside a kept attempt
    assert adapter.phase is _Phase.RERUN


def test_a_te_paged_runner_over_the_layers_refuses_megatrons() -> None:
    adapter = MegatronLoopAdapter()
    adapter.note_runner(object())  # MegatronPagedStashRunner's attach_runner
    with pytest.raises(TypeError, match="one runner per step"):
        adapter.probe()
    with pytest.raises(TypeError, match="one runner per step"):
        adapter.check()
    adapter.phase = _Phase.RUNNING
    adapter.on_optimizer_step()  # te_paged's own runner read the flags: no guard here


def test_an_unchecked_training_attempt_stops_the_next_optimizer_step_once() -> None:
    adapter = MegatronLoopAdapter()
    adapter.phase = _Phase.RUNNING  # after a probe: a training attempt nobody checked
    with pytest.raises(RuntimeError, match="never checked"):
        adapter.on_optimizer_step()
    assert adapter.phase is _Phase.UNREAD  # then out of the way until a runner probes again
    adapter.on_optimizer_step()
    adapter.phase, adapter._forward_only = _Phase.RUNNING, True
    adapter.on_optimizer_step()  # an evaluation's attempt: no optimizer step belongs to it


def test_the_global_optimizer_hook_does_not_keep_the_adapter_alive() -> None:
    import gc
    import weakref

    import torch

    adapter = MegatronLoopAdapter()
    ref = weakref.ref(adapter)
    del adapter
    gc.collect()
    assert ref() is None
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    optimizer.step()  # its hook is gone with it: nothing raises


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), "2.0", True])
def test_an_odd_factor_written_by_megatrons_runner_is_refused(value) -> None:
    # Before: any value but None was taken as "the attempt is kept", and the step went on.
    adapter = MegatronLoopAdapter()
    adapter.phase = _Phase.RERUN
    with pytest.raises(ValueError, match="positive finite factor"):
        adapter.set_capacity_factor(value)


@pytest.mark.parametrize("training, free", [(False, True), (True, False)])
def test_an_inference_pass_outside_a_runner_starts_no_attempt(training, free) -> None:
    """An RL framework's logprob pass between steps (eval mode, no autograd, no runner on the
    stack): the layer runs it dropless and unstashed (``True``), and the adapter's step is left
    as it was; a no-grad pass in training mode keeps the static budget but starts nothing."""
    adapter = MegatronLoopAdapter()
    adapter.phase = _Phase.READY  # between two steps Megatron's runner kept
    assert adapter.on_forward(training=training, grad=False) is free
    assert adapter.phase is _Phase.READY


def test_inside_a_te_paged_runners_step_a_pass_is_the_runners() -> None:
    class Runner:
        in_step = False

    adapter = MegatronLoopAdapter()
    runner = Runner()
    adapter.note_runner(runner)
    assert adapter.on_forward(training=False, grad=False)  # between the runner's steps
    runner.in_step = True  # an evaluation step of the runner: it reads the flags
    assert not adapter.on_forward(training=False, grad=False)
