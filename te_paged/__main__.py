"""``python -m te_paged`` is ``te-paged``."""

import sys

from te_paged.cli import main

sys.exit(main())
