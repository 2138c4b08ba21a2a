"""Imported once by the forkserver that ``te-paged ab --engine torchtitan --device cpu`` forks
its ranks from (``te_paged.tools.ab_command``): torchtitan's trainer and te_paged's integration,
about 6 s of CPU a rank on a 2-core machine, paid once instead of once per rank. Never imported
for ``--device cuda``: an import that initialises CUDA would leave the forked ranks unable to
use it."""

import torchtitan.trainer  # noqa: F401

import te_paged.integrations.torchtitan.cpu_shims
import te_paged.integrations.torchtitan.trainer
import te_paged.tools.torchtitan_ab  # noqa: F401
