"""Imported once by the forkserver that ``te-paged ab --engine megatron --device cpu`` forks its
ranks from (``te_paged.tools.ab_command``): megatron-core's modules that every rank imports,
about 4 s of CPU a rank on a 2-core machine, paid once instead of once per rank. Quiets their
import-time warnings first, as each rank does. Never imported for ``--device cuda``: an import
that initialises CUDA would leave the forked ranks unable to use it."""

from te_paged.tools.megatron_ab import quiet_megatron

quiet_megatron()

import megatron.core.distributed  # noqa: E402
import megatron.core.models.gpt.gpt_layer_specs  # noqa: E402
import megatron.core.models.gpt.gpt_model  # noqa: E402
import megatron.core.models.mimo.model.base  # noqa: E402 (0.19.2's optimizer factory imports it)
import megatron.core.optimizer  # noqa: E402
import megatron.core.pipeline_parallel  # noqa: E402, F401

import te_paged.integrations.megatron.cpu_shims  # noqa: E402, F401
