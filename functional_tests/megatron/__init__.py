"""Megatron-core integration: a functional test launched with torchrun."""
