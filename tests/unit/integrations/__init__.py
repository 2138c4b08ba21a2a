"""Tests of te_paged.integrations."""
