"""``python -m te_paged`` is ``te-paged``."""

from te_paged.cli import entry

entry()
