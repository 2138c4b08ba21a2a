"""Imported once by the forkserver that ``te-paged ab --engine bridge`` forks its ranks from (and
by the Bridge functional tests' launcher): the CPU shims for Megatron-Bridge's training loop
(``cpu_shims.install(training_loop=True)``, which must come before Bridge is imported), then
Bridge's training modules and what they import (transformers, modelopt: 8 to 10 s of CPU a rank
on a 2-core machine), paid once instead of once per rank. CPU only, like
:mod:`te_paged.tools.preload_megatron`."""

import logging

import te_paged.tools.preload_megatron  # noqa: F401 - quiets Megatron's import warnings first
from te_paged.integrations.megatron import cpu_shims

# Import-time notes at INFO: Bridge logs the traceback of each optional import that fails
# without Transformer Engine, and datasets that it found JAX.
for name in ("megatron.bridge.utils.import_utils", "datasets"):
    logging.getLogger(name).setLevel(logging.WARNING)

cpu_shims.install(training_loop=True)

import megatron.bridge.training.finetune  # noqa: E402
import megatron.bridge.training.gpt_step  # noqa: E402
import megatron.bridge.training.pretrain  # noqa: E402, F401
