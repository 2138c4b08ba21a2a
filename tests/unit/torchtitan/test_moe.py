"""te_paged's torchtitan layers in one process (no Trainer): arithmetic, paging, conversion and
the refusals. The Trainer, expert parallelism and reruns: functional_tests/torchtitan."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchtitan")  # installed by scripts/test.sh; never skipped in CI

from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.token_dispatcher import DeepEPTokenDispatcher

from te_paged.integrations.torchtitan import (
    PagedGroupedExperts,
    PagedRoutedExperts,
    PagedStashConverter,
    StaticBudgetTokenDispatcher,
    attach_paged_stash,
    convert_moe,
)
from te_paged.runtime import PagedStashRunner
from te_paged.tools.torchtitan_ab import TorchtitanModelConfig, model_spec

E, D, F = 4, 32, 16


def _experts(cls, **kw):
    torch.manual_seed(0)
    m = cls.Config(dim=D, hidden_dim=F, num_experts=E, **kw).build()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return m


def _rows(rows=40, real=29):
    torch.manual_seed(1)
    counts = torch.tensor([7, 0, 12, real - 19])
    x = torch.randn(rows, D)
    x[real:] = 0  # the static buffer's padding
    return x, counts


def _run(module, x, counts):
    x = x.clone().requires_grad_()
    out = module(x, counts)
    real = int(counts.sum())
    out[:real].square().sum().backward()
    grads = [x.grad[:real]] + [p.grad for p in module.parameters()]
    return out[:real].detach(), grads


def test_paged_experts_without_the_stash_are_torchtitans_grouped_experts_bit_for_bit():
    x, counts = _rows()
    stock = _run(_experts(GroupedExperts), x, counts)
    ours = _run(_experts(PagedGroupedExperts, moe_paged_stash=False), x, counts)
    assert torch.equal(stock[0], ours[0])
    assert all(torch.equal(a, b) for a, b in zip(stock[1], ours[1]))


def test_paged_experts_page_the_input_once_and_four_intermediates_bitwise():
    x, counts = _rows()
    reference = _run(_experts(PagedGroupedExperts, moe_paged_stash=False), x, counts)
    # One layer, whose backward comes first: paged only with the skip off.
    module = _experts(PagedGroupedExperts, moe_paged_stash_skip_immediate_backward=False)
    (manager,) = attach_paged_stash(module, "cpu")
    for step in range(2):  # the capture step, then one with the pool
        manager.reset()
        module.zero_grad(set_to_none=True)
        got = _run(module, x, counts)
        stats = manager.stats()
        # bf16 input (saved by two grouped GEMMs, paged once) + silu's input + the product's
        # two inputs + the last GEMM's input.
        assert stats.stashes == stats.pops == 5, step
        assert torch.equal(got[0], reference[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], reference[1]))
    assert manager.stats().pool_bytes > 0


def test_experts_with_the_stash_on_and_no_manager_refuse_to_record():
    x, counts = _rows()
    module = _experts(PagedGroupedExperts)
    with pytest.raises(RuntimeError, match="attach_paged_stash"):
        module(x.requires_grad_(), counts)
    with torch.no_grad():
        module(x, counts)  # nothing saved: no manager needed


def _model_config(**kw):
    cfg = TorchtitanModelConfig(layers=2, experts=4, hidden=32, ffn=32, heads=2, vocab=64,
                                seq_length=16, micro_batch_size=2, **kw)  # fmt: skip
    return model_spec(cfg).model


def _build(model_config):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def test_convert_moe_swaps_every_moe_layer_and_keeps_parameter_names():
    stock = _build(_model_config())
    converted = _build(convert_moe(_model_config(), moe_expert_rank_capacity_factor=1.5))
    routed = [m for m in converted.modules() if isinstance(m, PagedRoutedExperts)]
    assert len(routed) == 2
    for r in routed:
        assert isinstance(r.inner_experts, PagedGroupedExperts)
        assert isinstance(r.token_dispatcher, StaticBudgetTokenDispatcher)
        assert r.token_dispatcher.capacity_factor == 1.5
        assert r.token_dispatcher.moe_config(2).a2a_capacity_factor == 1.5  # auto: starts at cf
    assert stock.state_dict().keys() == converted.state_dict().keys()
    narrow = convert_moe(_model_config(), moe_a2a_capacity_factor=1.1)
    for _fqn, node, _p, _a in narrow.traverse(PagedRoutedExperts.Config):
        assert node.token_dispatcher.moe_a2a_capacity_factor == 1.1
    converted.load_state_dict(stock.state_dict())  # checkpoints carry over as they are


def test_a_converted_model_refuses_to_train_without_a_runner_and_trains_under_one():
    model = _build(convert_moe(_model_config(), moe_paged_stash=False))
    tokens = torch.randint(0, 64, (2, 16))
    with pytest.raises(RuntimeError, match="PagedStashTrainer"):
        model(tokens)
    with torch.no_grad():
        model(tokens)  # evaluation saves nothing and drops nothing it keeps: allowed
    runner = PagedStashRunner(model)
    _, record = runner.step(lambda: model(tokens).sum().backward())
    assert record.attempt in (1, 2)
    dropless = _build(convert_moe(_model_config(), moe_paged_stash=False,
                                  moe_expert_rank_capacity_factor=None))  # fmt: skip
    dropless(tokens).sum().backward()  # no budget, nothing to drop: no runner needed


def test_the_converter_is_the_model_registry_entry_point():
    converter = PagedStashConverter.Config(moe_expert_rank_capacity_factor=2.0).build()
    cfg = converter.convert(_model_config())
    (node,) = {type(n) for _f, n, _p, _a in cfg.traverse(PagedRoutedExperts.Config)}
    assert node is PagedRoutedExperts.Config


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"moe_expert_rank_capacity_factor": 0}, ValueError, "positive"),
        ({"moe_expert_rank_capacity_factor": "1.5"}, ValueError, "positive"),
        ({"moe_paged_stash_page_size": 0}, ValueError, "page_size"),
        ({"capacity_factor": 1.5}, TypeError, "unknown te_paged option"),
        (
            {"moe_expert_rank_capacity_factor": 1.2, "moe_a2a_capacity_factor": 1.5},
            ValueError,
            "larger than",
        ),
    ],
)
def test_convert_moe_refuses_bad_options(options, error, match):
    with pytest.raises(error, match=match):
        convert_moe(_model_config(), **options)


@pytest.mark.parametrize("value", ["false", 0, None])
def test_the_stash_switch_must_be_a_bool_where_given(value):
    # Before: convert_moe(moe_paged_stash="false") paged (a non-empty string is true).
    from te_paged.integrations.torchtitan import PagedStashConverter

    with pytest.raises(TypeError, match=f"moe_paged_stash must be True or False, got {value!r}"):
        convert_moe(_model_config(), moe_paged_stash=value)
    with pytest.raises(TypeError, match="moe_paged_stash must be True or False"):
        PagedStashConverter.Config(moe_paged_stash=value)  # at the config, not at conversion


@pytest.mark.parametrize("name", ["convert_moe", "grow_pool", "per_rank_pools", "grow_capacity"])
def test_the_trainer_section_refuses_a_non_bool_switch_where_given(name):
    # Before: TePagedConfig(convert_moe="no") converted, and the runner's switches were checked
    # only after the model was built.
    from te_paged.integrations.torchtitan.trainer import TePagedConfig

    with pytest.raises(TypeError, match=f"{name} must be True or False, got 'no'"):
        TePagedConfig(**{name: "no"})
    assert TePagedConfig().stash_options()["moe_paged_stash"] is True


def test_a_wire_factor_without_an_expert_budget_is_refused():
    # Before: accepted, and the wire factor did nothing (None is dropless: no wire to size).
    with pytest.raises(ValueError, match="moe_expert_rank_capacity_factor=None is dropless"):
        convert_moe(_model_config(), moe_expert_rank_capacity_factor=None,
                    moe_a2a_capacity_factor=1.0)  # fmt: skip
    convert_moe(_model_config(), moe_expert_rank_capacity_factor=None)  # dropless alone: fine


@pytest.mark.parametrize(
    "options",
    [{"moe_expert_rank_capacity_factor": 1.5}, {"moe_a2a_capacity_factor": 1.0},
     {"moe_expert_rank_capacity_factor": 2.0, "moe_a2a_capacity_factor": 1.0}],
)  # fmt: skip
def test_a_hybridep_model_refuses_the_budget_knobs_it_would_ignore(options):
    # Before: accepted and ignored: HybridEP's budget is its non_blocking_capacity_factor.
    from te_paged.integrations.torchtitan import PagedStashConverter

    with pytest.raises(ValueError, match="HybridEP, whose budget is its own"):
        convert_moe(_model_config(hybridep_factor=0.5), **options)
    with pytest.raises(ValueError, match="HybridEP, whose budget is its own"):
        PagedStashConverter(PagedStashConverter.Config(**options)).convert(
            _model_config(hybridep_factor=0.5)
        )
    # The converter's defaults are not "given": a HybridEP model converts with them.
    PagedStashConverter(PagedStashConverter.Config()).convert(_model_config(hybridep_factor=0.5))


def test_convert_moe_refuses_what_it_would_replace_silently():
    cfg = _model_config()
    deepep = DeepEPTokenDispatcher.Config(num_experts=4, top_k=2)
    cfg.layers[1].moe.routed_experts.token_dispatcher = deepep
    with pytest.raises(ValueError, match="standard"):
        convert_moe(cfg)
    with pytest.raises(ValueError, match="no RoutedExperts"):
        convert_moe(cfg.layers[0])


def test_the_trainer_refuses_cuda_graphs():
    from torchtitan.config import TrainingConfig

    from te_paged.integrations.torchtitan.trainer import PagedStashTrainer

    with pytest.raises(ValueError, match="disable_cuda_graphs"):
        PagedStashTrainer.Config(training=TrainingConfig(disable_cuda_graphs=False))


def test_cpu_shims_refuse_a_cuda_machine(monkeypatch):
    from te_paged.integrations.torchtitan import cpu_shims

    monkeypatch.setattr(cpu_shims, "_installed", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CPU-only"):
        cpu_shims.install()


def test_importing_te_paged_does_not_import_torchtitan_and_its_absence_names_the_install():
    code = (
        "import sys, te_paged, te_paged.tools.torchtitan_ab, te_paged.cli\n"
        "assert 'torchtitan' not in sys.modules, 'imported torchtitan'\n"
        "sys.modules['torchtitan'] = None\n"
        "try:\n"
        "    import te_paged.integrations.torchtitan\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install -c" in out.stdout and "torchtitan==0.3.0" in out.stdout


def test_the_dispatchers_combine_never_reads_the_padding_rows():
    # torch._grouped_mm leaves rows past the last group uninitialised: NaN there must reach
    # neither the output nor the routing scores' gradient (0 × NaN is NaN).
    dispatcher = StaticBudgetTokenDispatcher.Config(
        num_experts=4, top_k=2, dim=8, moe_expert_rank_capacity_factor=2.0
    ).build()
    torch.manual_seed(0)
    x = torch.randn(16, 8, requires_grad=True)
    scores = torch.rand(16, 2, requires_grad=True)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(16)])
    routed, counts, meta = dispatcher.dispatch(x, scores, ids, torch.zeros(4))
    real = int(counts.sum())
    assert routed.shape[0] > real  # a static buffer with padding
    out = routed * 2
    out = torch.cat([out[:real], torch.full_like(out[real:], float("nan"))])
    y = dispatcher.combine(out, meta, x)
    y.square().sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(scores.grad).all()
    assert torch.isfinite(x.grad).all()


def test_the_override_converts_every_moe_layer_with_its_options():
    from torchtitan.config.override import OverrideConfig, apply_overrides

    cfg = _model_config()
    name = "te_paged.integrations.torchtitan.overrides.paged_stash_moe"
    imports = [(name, {"moe_expert_rank_capacity_factor": 1.5, "moe_paged_stash_page_size": 32})]
    apply_overrides(OverrideConfig(imports=imports), cfg)
    nodes = [n for _f, n, _p, _a in cfg.traverse(PagedRoutedExperts.Config)]
    assert len(nodes) == 2
    assert {n.token_dispatcher.moe_expert_rank_capacity_factor for n in nodes} == {1.5}
    assert {n.inner_experts.moe_paged_stash_page_size for n in nodes} == {32}


def test_qwen3_moe_converts_and_builds():
    from torchtitan.models.qwen3 import model_registry

    spec = model_registry("debugmodel_moe", converters=[PagedStashConverter.Config()])
    with torch.device("meta"):
        model = spec.model.build()
    routed = [m for m in model.modules() if isinstance(m, PagedRoutedExperts)]
    assert routed and all(isinstance(r.inner_experts, PagedGroupedExperts) for r in routed)


def test_the_te_paged_section_is_set_from_torchtitans_command_line(tmp_path, monkeypatch):
    (tmp_path / "my_registry.py").write_text(
        "from te_paged.integrations.torchtitan.trainer import PagedStashTrainer\n"
        "from te_paged.tools.torchtitan_ab import TorchtitanModelConfig, model_spec\n"
        "from torchtitan.config import TrainingConfig\n"
        "def tiny():\n"
        "    spec = model_spec(TorchtitanModelConfig(layers=1, experts=4, hidden=32, ffn=32,\n"
        "                                            heads=2, vocab=64, seq_length=16))\n"
        "    return PagedStashTrainer.Config(\n"
        "        model_spec=spec, training=TrainingConfig(disable_cuda_graphs=True))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from torchtitan.config import ConfigManager

    from te_paged.integrations.torchtitan.trainer import PagedStashTrainer

    config = ConfigManager().parse_args([
        "--module", "my_registry", "--config", "tiny",
        "--te_paged.moe_expert_rank_capacity_factor", "1.5", "--te_paged.no-grow-pool",
    ])  # fmt: skip
    assert isinstance(config, PagedStashTrainer.Config)
    assert config.te_paged.moe_expert_rank_capacity_factor == 1.5
    assert config.te_paged.grow_pool is False
