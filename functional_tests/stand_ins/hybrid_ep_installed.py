"""Importing this installs the HybridEP stand-in (:mod:`functional_tests.stand_ins.deep_ep`) as
the ``deep_ep`` module. It must come before megatron-core's ``fused_a2a`` (which tries
``from deep_ep import HybridEPBuffer`` once, at import): a launch preloads it first
(``functional_tests.megatron.workers_launch(..., stand_ins=...)``)."""

from __future__ import annotations

import sys

from functional_tests.stand_ins import deep_ep

if "megatron.core.transformer.moe.fused_a2a" in sys.modules and "deep_ep" not in sys.modules:
    raise RuntimeError(
        "megatron-core's fused_a2a was imported before the HybridEP stand-in: import "
        "functional_tests.stand_ins.hybrid_ep_installed first"
    )
sys.modules["deep_ep"] = deep_ep
sys.modules["deep_ep.hybrid_ep_buffer"] = deep_ep.hybrid_ep_buffer
