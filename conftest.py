"""Test-session setup for every test directory (tests/, functional_tests/), loaded before either is
collected."""

import os

# Triton reads this when its @triton.jit decorators run, i.e. when te_paged.kernels.triton_stash
# is first imported, so it must be set before any test module imports it. CPU runs interpret the
# kernels; GPU runs export TRITON_INTERPRET=0 to compile them.
os.environ.setdefault("TRITON_INTERPRET", "1")
