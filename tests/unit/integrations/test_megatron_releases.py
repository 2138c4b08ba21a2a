"""The supported megatron-core releases: the release table, reading Megatron's own paged-stash
fields (0.19.2), overrides that contradict the config, and the CPU shims per release.

These run in the test process, which imports megatron-core 0.19.2 (the test environment's
default: see scripts/megatron.sh); 0.16.1 is exercised by the functional tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="megatron-core (scripts/test.sh installs it)")

from te_paged.integrations.megatron import (
    StaticBudgetTokenDispatcher,
    cpu_shims,
    megatron_moe_config,
    releases,
)
from te_paged.integrations.megatron.common import PAGED_STASH_FIELDS, split_paged_stash_fields


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "ffn_hidden_size": 128,
        "num_moe_experts": 8,
        "moe_ffn_hidden_size": 128,
        "moe_router_topk": 2,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "use_cpu_initialization": True,
    }
    return TransformerConfig(**{**base, **kw})


#: A config as a user of Megatron 0.19.2's built-in stash writes it.
BUILTIN_STASH = {
    "moe_token_dispatcher_type": "flex",
    "moe_flex_dispatcher_backend": "ncclep",
    "moe_expert_rank_capacity_factor": 1.7,
    "moe_paged_stash": True,
    "moe_paged_stash_page_size": 32,
    "moe_paged_stash_buffer_size_factor_cuda": -1.3,  # Megatron's "observed peak" sign
    "moe_paged_stash_buffer_size_factor_cpu": 0.5,
}


def test_the_installed_release_is_in_the_table_and_its_version_has_no_git_hash() -> None:
    import megatron.core

    assert releases.installed_version() == "0.19.2"
    assert "+" in megatron.core.__version__  # 0.19.2 appends the git hash of its folder
    release = releases.installed_release()
    assert release is releases.RELEASES["0.19.2"]
    assert release.config_has_paged_stash_fields and release.builtin_paged_stash
    assert releases.SUPPORTED == ("0.16.1", "0.19.2")
    assert not releases.RELEASES["0.16.1"].config_has_paged_stash_fields


def test_another_release_is_refused_naming_the_supported_ones(monkeypatch) -> None:
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "VERSION", (0, 17, 0, ""))
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.17\.0 is installed; te_paged "
                       r"supports megatron-core 0\.16\.1 and 0\.19\.2"):  # fmt: skip
        releases.installed_release()
    with pytest.raises(RuntimeError, match=r"0\.16\.1 and 0\.19\.2"):
        cpu_shims.install()
    assert not cpu_shims.installed()


#: Megatron modules te_paged imports (spec builders, runners, the CLI's engine), whose import
#: chains take in most of megatron-core.
MEGATRON_MODULES_USED = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.moe.moe_layer",
)


@pytest.mark.parametrize("version", releases.SUPPORTED)
def test_the_release_check_does_not_import_megatron_core(version) -> None:
    """``te-paged ab --engine megatron``'s parent process checks the release and builds no
    model: reading the version must not run megatron-core's ``__init__`` (6 s of CPU)."""
    from functional_tests.megatron import release_folder

    code = ("import sys\nfrom te_paged.integrations.megatron.releases import installed_release\n"
            "print(installed_release().version, 'megatron.core' in sys.modules)")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(release_folder(version)),
                                                          os.environ.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [version, "False"]


@pytest.mark.parametrize("version", releases.SUPPORTED)
def test_the_install_line_names_what_the_release_imports_without_declaring_it(version) -> None:
    """``--no-deps`` keeps pip away from torch, and so from every dependency the release does
    not declare: on a CPU torch, which brings no triton, megatron-core 0.19.2 does not import
    without the ``triton`` its install line adds. Each release imports, in a process of its
    own, with triton hidden; it must fail exactly when its line names triton."""
    from functional_tests.megatron import release_folder

    folder = release_folder(version)  # where scripts/megatron.sh installs each release
    assert (folder / "megatron" / "core" / "package_info.py").is_file(), folder
    code = "\n".join(["import sys", "sys.modules['triton'] = None",  # import triton fails
                      *(f"import {name}" for name in MEGATRON_MODULES_USED)])  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(folder), "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    needs_triton = proc.returncode != 0
    if needs_triton:
        assert "triton" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]
    assert needs_triton == ("triton" in releases.install_line(version).split()), version
    assert needs_triton == (version == "0.19.2")  # what scripts/megatron.sh installs for


def test_every_shim_a_release_names_exists_and_every_shim_is_used() -> None:
    named = {name for r in releases.RELEASES.values() for name in r.cpu_shims}
    assert named == set(cpu_shims.SHIMS)
    new_in_0_19 = set(releases.RELEASES["0.19.2"].cpu_shims) - set(
        releases.RELEASES["0.16.1"].cpu_shims
    )
    assert new_in_0_19 == {"builtin_stash_manager", "current_stream", "hybrid_final_norm"}
    for name in cpu_shims.SHIMS:  # the documented table names every shim
        assert f"``{name}``" in cpu_shims.__doc__, name
    # The training loop's: 0.19.2 alone, each one in its module's table.
    from te_paged.integrations.megatron import cpu_loop_shims

    loop = {name for r in releases.RELEASES.values() for name in r.cpu_loop_shims}
    assert loop == set(cpu_loop_shims.LOOP_SHIMS)
    assert releases.RELEASES["0.16.1"].cpu_loop_shims == ()
    assert list(releases.RELEASES["0.19.2"].cpu_loop_shims) == list(cpu_loop_shims.LOOP_SHIMS)
    for name in cpu_loop_shims.LOOP_SHIMS:
        assert f"``{name}``" in cpu_loop_shims.__doc__, name


def test_the_training_loop_shims_are_refused_for_a_release_without_them(monkeypatch) -> None:
    monkeypatch.setattr(releases, "installed_release", lambda: releases.RELEASES["0.16.1"])
    monkeypatch.setattr(cpu_shims, "installed_release", lambda: releases.RELEASES["0.16.1"])
    monkeypatch.setitem(cpu_shims._state, "installed", True)  # the core shims: not re-applied
    with pytest.raises(RuntimeError, match=r"training loop on CPU with megatron-core 0\.19\.2 "
                       r"only; 0\.16\.1 is installed"):  # fmt: skip
        cpu_shims.install(training_loop=True)
    assert not cpu_shims._state["loop"]


def test_megatrons_own_fields_are_read_from_the_config_without_overrides() -> None:
    cfg = megatron_moe_config(_config(**BUILTIN_STASH))
    assert cfg.moe_paged_stash and cfg.moe_expert_rank_capacity_factor == 1.7
    assert cfg.moe_paged_stash_page_size == 32
    assert cfg.moe_paged_stash_buffer_size_factor_cuda == -1.3
    assert cfg.moe_paged_stash_buffer_size_factor_cpu == 0.5


def test_the_spec_of_a_builtin_stash_config_builds_a_manager_with_its_factors() -> None:
    from te_paged.integrations.megatron import get_te_paged_moe_spec

    spec = get_te_paged_moe_spec(_config(**BUILTIN_STASH), device="cpu")
    assert spec.module.__name__ == "PagedStashMoELayer"
    manager = spec.submodules.experts.params["manager"]
    assert (manager.page_size, manager.buffer_size_factor_cuda) == (32, -1.3)
    assert manager.buffer_size_factor_cpu == 0.5


def test_overrides_fill_default_fields_but_may_not_contradict_the_config() -> None:
    plain = _config()  # the 0.16.1 style: te_paged's fields as overrides
    cfg = megatron_moe_config(plain, moe_paged_stash=True, moe_expert_rank_capacity_factor=2.0)
    assert cfg.moe_paged_stash and cfg.moe_expert_rank_capacity_factor == 2.0
    same = megatron_moe_config(_config(**BUILTIN_STASH), moe_paged_stash=True)  # agrees: fine
    assert same.moe_paged_stash
    with pytest.raises(ValueError, match=r"moe_expert_rank_capacity_factor: the config says "
                       r"1\.7, the override 2\.0.*Set each field in one place"):  # fmt: skip
        megatron_moe_config(_config(**BUILTIN_STASH), moe_expert_rank_capacity_factor=2.0)
    with pytest.raises(ValueError, match="moe_router_topk: the config says 2, the override 1"):
        megatron_moe_config(_config(moe_router_topk=2), moe_router_topk=1)


def test_the_fields_go_on_the_config_of_a_release_that_has_them() -> None:
    fields = {
        "moe_expert_rank_capacity_factor": 2.0,
        "moe_paged_stash": True,
        "moe_paged_stash_page_size": 16,
        "moe_paged_stash_buffer_size_factor_cuda": 1.1,
        "moe_paged_stash_buffer_size_factor_cpu": 0.0,
        "moe_paged_stash_kernel_backend": "torch",
    }
    native, overrides = split_paged_stash_fields(**fields)
    assert set(native) == {*PAGED_STASH_FIELDS, "moe_token_dispatcher_type",
                           "moe_flex_dispatcher_backend"}  # fmt: skip
    assert overrides == {"moe_paged_stash_kernel_backend": "torch"}
    cfg = megatron_moe_config(_config(**native), **overrides)  # 0.19.2's validation accepts it
    assert cfg.moe_paged_stash_page_size == 16 and cfg.moe_paged_stash_kernel_backend == "torch"


def test_the_fields_stay_overrides_on_a_release_without_them(monkeypatch) -> None:
    monkeypatch.setattr(releases, "installed_release", lambda: releases.RELEASES["0.16.1"])
    native, overrides = split_paged_stash_fields(moe_paged_stash=True)
    assert (native, overrides) == ({}, {"moe_paged_stash": True})


def test_megatrons_runner_is_refused_by_a_dispatcher_without_a_loop_adapter() -> None:
    cfg = megatron_moe_config(_config(), moe_expert_rank_capacity_factor=2.0)
    dispatcher = StaticBudgetTokenDispatcher(cfg, None, align=0, device="cpu")
    # Megatron's PagedStashRunner finds its layers with exactly this lookup; a dispatcher built
    # alone (not by PagedStashMoELayer) has no adapter to report its flags to.
    with pytest.raises(TypeError, match=r"built without a MegatronLoopAdapter.*"
                       r"MegatronPagedStashRunner\(model, optimizer\)"):  # fmt: skip
        hasattr(dispatcher, "check_over_budget")
    assert dispatcher.get_expert_zero_copy_buffers() == (None, None)
    # 0.19.2's alignment 0 (no quantisation) is no alignment: int(2 x 2 x 50) rows.
    x = torch.randn(50, cfg.hidden_size)
    probs = torch.full((50, 2), 0.5)
    indices = torch.stack([torch.arange(50) % 8, (torch.arange(50) + 1) % 8], dim=1)
    dispatcher.token_dispatch(x, (probs, indices))
    assert dispatcher.budget.budget_tokens == 200


def test_builtin_stash_manager_shim_makes_the_global_manager_without_cuda() -> None:
    from megatron.core.transformer.moe import paged_stash

    saved = paged_stash.PagedStashManager.STASH_MGR
    paged_stash.PagedStashManager.STASH_MGR = None
    try:
        with pytest.raises(RuntimeError, match="CUDA"):  # what Megatron does on a CPU alone
            paged_stash.PagedStashManager.get_instance()
        cpu_shims._patch_builtin_stash_manager(None)
        manager = paged_stash.PagedStashManager.get_instance()
        assert isinstance(manager.pack_stream, cpu_shims._PlaceholderStream)
        assert manager.stash_buffers is None and torch.cuda.Stream is not None
        with pytest.raises(RuntimeError, match="CUDA"):  # torch.cuda.Stream itself is untouched
            torch.cuda.Stream()
    finally:
        paged_stash.PagedStashManager.STASH_MGR = saved


def test_memory_tracker_reads_a_module_whose_buffers_attribute_is_a_list() -> None:
    from te_paged.runtime.memory import measure_peak

    class Wrapper(torch.nn.Module):  # what Megatron's DDP does
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(8, 8)
            self.register_buffer("scale", torch.ones(8))
            self.buffers = [torch.zeros(4)]

        def forward(self, x):
            return self.module(x) * self.scale

    model = Wrapper()
    result, report = measure_peak(lambda: model(torch.randn(16, 8)).sum().backward(), "cpu")
    assert result is None and report.peak_bytes > 0
    assert model.module.weight.grad is not None


def test_te_paged_runner_refuses_megatrons_stashing_experts() -> None:
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from te_paged.integrations.megatron.runner import _refuse_megatron_stash

    experts = TEGroupedMLP.__new__(TEGroupedMLP)  # Megatron's class; no TE needed to check it
    torch.nn.Module.__init__(experts)
    experts.config = types.SimpleNamespace(moe_paged_stash=True)
    experts._with_fused_impl = True
    model = torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict({"experts": experts})})
    with pytest.raises(ValueError, match=r"mlp\.experts is Megatron's own TEGroupedMLP on the "
                       r"op-fuser path with moe_paged_stash=True"):  # fmt: skip
        _refuse_megatron_stash([model])
    experts._with_fused_impl = False  # unfused: never touches Megatron's stash
    _refuse_megatron_stash([model])
    experts._with_fused_impl, experts.config.moe_paged_stash = True, False
    _refuse_megatron_stash([model])
