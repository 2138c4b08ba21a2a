"""``python -m benchmarks.gpu_check``: what ``bash scripts/gpu_check.sh`` runs."""

import sys

from .runner import main

sys.exit(main())
