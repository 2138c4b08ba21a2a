"""torchtitan 0.3.0 integration: functional tests launched with torchrun on CPU ranks (gloo)."""
