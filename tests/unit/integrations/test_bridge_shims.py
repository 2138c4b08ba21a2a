"""te_paged's pieces for Megatron-Bridge that run without Bridge: the import hooks its CPU shims
stand on (patches applied where a module is made, stand-ins given to named importers only),
the Bridge release table, each shim's patch on a module of the same shape, and where the loop
adapter finds Bridge's logging state. Bridge itself runs on 4 ranks in
functional_tests/megatron_bridge (this process never imports it: its CPU shims would patch
megatron-core for every test here)."""

from __future__ import annotations

import sys
import textwrap
import types
import weakref

import pytest
import torch

from te_paged.integrations.megatron import cpu_bridge_shims, log_sources, releases
from te_paged.integrations.megatron.cpu_import_hooks import ImportHooks


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``hookpkg`` on ``sys.path`` whose modules the test writes; every module of it
    and the hooks a test installs are gone afterwards."""
    root = tmp_path / "hookpkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    installed: list[ImportHooks] = []

    def write(name: str, source: str) -> None:
        (root / f"{name}.py").write_text(textwrap.dedent(source))

    yield write, installed
    for hooks in installed:
        sys.meta_path.remove(hooks)
    for name in [n for n in sys.modules if n == "hookpkg" or n.startswith("hookpkg.")]:
        del sys.modules[name]


def test_a_named_importer_gets_stand_ins_for_a_library_that_cannot_load(package) -> None:
    write, installed = package
    write(
        "user",
        """
        import no_such_library_te.pytorch as te
        from no_such_library_rx.inprocess import CallWrapper

        class Layer:
            def fused(self) -> te.ops.Sequential:  # evaluated when the class is made
                return te.ops.Linear(4, 4)

        def wrapped(w: CallWrapper | None = None):
            return w
    """,
    )
    write(
        "prober",
        """
        try:
            import no_such_library_te
            HAVE = True
        except ImportError:
            HAVE = False
    """,
    )
    hooks = ImportHooks()
    hooks.stand_ins["hookpkg.user"] = ("no_such_library_te", "no_such_library_rx")
    hooks.install()
    installed.append(hooks)
    from hookpkg import prober, user

    assert user.te.__qualname__ == "no_such_library_te.pytorch"
    assert not isinstance(object(), user.te.ops.Sequential)  # a class no object is
    with pytest.raises(ImportError, match="no_such_library_te is not installed"):
        user.Layer().fused()  # using it raises, naming the library
    assert user.wrapped() is None
    # Nobody else sees a stand-in, and none is left in sys.modules for later importers.
    assert prober.HAVE is False
    assert "no_such_library_te" not in sys.modules


def test_a_library_that_loads_is_the_real_one_even_for_a_named_importer(package) -> None:
    write, installed = package
    write("user", "import json\nimport textwrap as tw\n")
    hooks = ImportHooks()
    hooks.stand_ins["hookpkg.user"] = ("json", "textwrap")
    hooks.install()
    installed.append(hooks)
    from hookpkg import user

    assert user.json is sys.modules["json"] and user.tw is textwrap


def test_a_patch_runs_before_any_importer_can_bind_the_name(package) -> None:
    write, installed = package
    write("target", "def build():\n    return 'original'\n")
    write("binder", "from hookpkg.target import build\n")  # binds at import, as Bridge does
    hooks = ImportHooks()
    hooks.patches["hookpkg.target"] = [lambda module: setattr(module, "build", lambda: "shim")]
    hooks.install()
    installed.append(hooks)
    from hookpkg import binder

    assert binder.build() == "shim"


def _bridge_folder(tmp_path, monkeypatch, version: str):
    """A ``megatron/bridge`` of ``version`` on ``sys.path`` (a namespace ``megatron``), beside
    the installed megatron-core 0.19.2."""
    bridge = tmp_path / "megatron" / "bridge"
    bridge.mkdir(parents=True)
    major, minor, patch = version.split(".")
    (bridge / "package_info.py").write_text(
        f"MAJOR, MINOR, PATCH = {major}, {minor}, {patch}\n"
        "__shortversion__ = f'{MAJOR}.{MINOR}.{PATCH}'\n"
        "__version__ = __shortversion__ + '+0123abc'  # the git hash Bridge appends\n"
    )
    (bridge / "__init__.py").write_text("raise ImportError('the release check imported Bridge')")
    monkeypatch.syspath_prepend(str(tmp_path))
    import megatron

    monkeypatch.setattr(megatron, "__path__", [str(tmp_path / "megatron"), *megatron.__path__])
    return bridge


def test_the_installed_bridge_release_is_read_without_importing_bridge(
    tmp_path, monkeypatch
) -> None:
    assert releases.installed_bridge_release() is None  # not on this process's path
    _bridge_folder(tmp_path, monkeypatch, "0.6.2")
    release = releases.installed_bridge_release()
    assert release is releases.BRIDGE_RELEASES["0.6.2"] and release.megatron_core == "0.19.2"
    assert "megatron.bridge" not in sys.modules


def test_another_bridge_release_is_refused_naming_the_supported_one(tmp_path, monkeypatch) -> None:
    _bridge_folder(tmp_path, monkeypatch, "0.5.1")
    with pytest.raises(RuntimeError, match=r"megatron-bridge 0\.5\.1 is installed; te_paged "
                       r"supports megatron-bridge 0\.6\.2"):  # fmt: skip
        releases.installed_bridge_release()


def test_every_bridge_shim_is_in_the_table_and_documented() -> None:
    named = {name for r in releases.BRIDGE_RELEASES.values() for name in r.cpu_shims}
    assert named == set(cpu_bridge_shims.BRIDGE_SHIMS)
    for name in cpu_bridge_shims.BRIDGE_SHIMS:
        assert f"``{name}``" in cpu_bridge_shims.__doc__, name


def test_the_shims_refuse_a_bridge_imported_before_them(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "megatron.bridge", types.ModuleType("megatron.bridge"))
    with pytest.raises(RuntimeError, match=r"megatron\.bridge was imported before"):
        cpu_bridge_shims.install(("bridge_dataloader_generator",), "0.6.2")


def _module(**attrs) -> types.ModuleType:
    module = types.ModuleType("bridge_module")
    module.__dict__.update(attrs)
    return module


def test_a_shim_whose_target_moved_raises_naming_itself_and_the_release() -> None:
    shim = cpu_bridge_shims.BRIDGE_SHIMS["bridge_dataloader_generator"]
    patch = cpu_bridge_shims._checked("bridge_dataloader_generator", shim, "0.6.2")
    with pytest.raises(RuntimeError, match=r"build_pretraining_data_loader is missing: the CPU "
                       r"shim 'bridge_dataloader_generator' no longer matches megatron-bridge "
                       r"0\.6\.2"):  # fmt: skip
        patch(_module())


def test_bridges_data_loaders_get_generators_of_their_own() -> None:
    def build_pretraining_data_loader(dataset, consumed_samples, *args, seed=None, **kwargs):
        return torch.utils.data.DataLoader(dataset, batch_size=2)

    samplers = _module(build_pretraining_data_loader=build_pretraining_data_loader)
    cpu_bridge_shims.BRIDGE_SHIMS["bridge_dataloader_generator"].patch(samplers)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    loader = samplers.build_pretraining_data_loader(list(range(8)), 0, seed=1234)
    assert loader.generator.initial_seed() == 1234
    next(iter(loader))  # an iterator draws its seed: from the loader's own generator
    assert torch.equal(torch.get_rng_state(), before)  # the default one (dropout's) untouched
    plain = build_pretraining_data_loader(list(range(8)), 0)
    next(iter(plain))
    assert not torch.equal(torch.get_rng_state(), before)  # what the shim guards against


def test_bridges_initialize_is_called_without_cuda_and_seeds_with_one_device() -> None:
    seen = {}

    def initialize_megatron(cfg, allow_no_cuda=False):
        seen["allow_no_cuda"] = allow_no_cuda

    def _set_random_seed(seed, *, pg_collection=None):
        seen["devices"] = torch.cuda.device_count()  # with none, Bridge skips the tracker

    setup = _module(initialize_megatron=initialize_megatron)
    initialize = _module(_set_random_seed=_set_random_seed)
    cpu_bridge_shims.BRIDGE_SHIMS["bridge_initialize_without_cuda"].patch(setup)
    cpu_bridge_shims.BRIDGE_SHIMS["bridge_rng_seeding"].patch(initialize)
    setup.initialize_megatron(object())
    initialize._set_random_seed(1234, pg_collection=None)
    assert seen == {"allow_no_cuda": True, "devices": 1}
    assert torch.cuda.device_count() == 0  # only while it runs


def test_the_flex_backend_check_asks_no_gpu_on_cpu() -> None:
    def validate_flex_dispatcher_backend(model_config):
        torch.cuda.get_device_properties(0)  # raises without a GPU

    config = _module(validate_flex_dispatcher_backend=validate_flex_dispatcher_backend)
    cpu_bridge_shims.BRIDGE_SHIMS["bridge_flex_backend_check"].patch(config)
    assert config.validate_flex_dispatcher_backend(object()) is None


class _GlobalState:
    def __init__(self) -> None:
        self.cfg = types.SimpleNamespace(logger=types.SimpleNamespace(log_interval=5))
        self.train_state = types.SimpleNamespace(step=9)
        self.tensorboard_logger = "writer"


def test_the_adapter_finds_bridges_state_in_the_frames_that_build_megatrons_runner(
    monkeypatch,
) -> None:
    state_module = types.ModuleType("megatron.bridge.training.state")
    state_module.GlobalState = _GlobalState
    assert log_sources.find_bridge_state() is None  # Bridge not imported
    monkeypatch.setitem(sys.modules, "megatron.bridge.training.state", state_module)

    def train(global_state):  # Bridge's train(): its runner is built here
        return build_runner()

    def build_runner():
        return log_sources.find_bridge_state()

    assert build_runner() is None  # no state in the calling frames
    state = _GlobalState()
    found = train(state)
    assert isinstance(found, weakref.ref) and found() is state
    assert log_sources.log_settings(None, found) == (5, 10, "writer")  # step 9 is being run
    assert log_sources.log_settings(2, found) == (2, 10, "writer")  # the adapter's own interval
