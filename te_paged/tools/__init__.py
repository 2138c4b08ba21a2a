"""Tooling around the library (the CLI's engines); nothing in the library imports it."""
