"""Importing this installs the NCCL EP stand-in (:mod:`functional_tests.stand_ins.te_ep`) into
megatron-core's ``fused_a2a``, as if Transformer Engine's ``transformer_engine.pytorch.ep``
had imported there.

A ``transformer_engine`` module in ``sys.modules`` would make the rest of megatron-core take
Transformer Engine for installed (it reads ``transformer_engine.__version__`` and much more),
so the stand-in is not left there: ``fused_a2a``'s own source runs a second time, with the
stand-in importable as ``transformer_engine.pytorch.ep`` for that run only, and the NCCL EP
names it defines (``te_ep``, ``HAVE_TE_EP``, the bootstrap, buffer, dispatch and combine
wrappers) replace those of the imported ``fused_a2a`` and of ``token_dispatcher``, which
imported them by name. Megatron's wrappers themselves are what run, over the stand-in. It may
come after megatron-core's import (a launch preloads it after the HybridEP stand-in, which must
come first).
"""

from __future__ import annotations

import sys
import types

from functional_tests.stand_ins import te_ep

#: The names megatron-core 0.19.2's fused_a2a defines for NCCL EP (fused_a2a.py:608-770).
NAMES = (
    "te_ep",
    "HAVE_TE_EP",
    "ensure_nccl_ep_bootstrapped",
    "nccl_ep_finalize",
    "alloc_ep_symm_buffer",
    "new_nccl_ep_buffer",
    "nccl_ep_dispatch",
    "nccl_ep_combine",
)


def install() -> None:
    from megatron.core.transformer.moe import fused_a2a, token_dispatcher

    if getattr(fused_a2a, "te_ep", None) is te_ep:
        return
    if fused_a2a.HAVE_TE_EP:
        raise RuntimeError("Transformer Engine's NCCL EP is installed: the stand-in is not needed")
    package = types.ModuleType("transformer_engine")
    package.__path__ = []
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.__path__ = []
    pytorch.ep = te_ep
    package.pytorch = pytorch
    fakes = {"transformer_engine": package, "transformer_engine.pytorch": pytorch,
             "transformer_engine.pytorch.ep": te_ep}  # fmt: skip
    if any(name in sys.modules for name in fakes):
        raise RuntimeError("a transformer_engine module is already imported")
    with open(fused_a2a.__file__) as f:
        code = compile(f.read(), fused_a2a.__file__, "exec")
    namespace = {"__name__": fused_a2a.__name__, "__file__": fused_a2a.__file__}
    sys.modules.update(fakes)
    try:
        exec(code, namespace)
    finally:
        for name in fakes:
            del sys.modules[name]
    if not namespace["HAVE_TE_EP"]:
        raise RuntimeError("fused_a2a did not import the NCCL EP stand-in")
    for name in NAMES:
        setattr(fused_a2a, name, namespace[name])
        if hasattr(token_dispatcher, name):
            setattr(token_dispatcher, name, namespace[name])


install()
