"""Integrations with training frameworks; each submodule imports its framework lazily."""
