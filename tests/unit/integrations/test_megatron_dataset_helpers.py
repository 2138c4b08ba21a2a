"""te_paged's numpy stand-ins for megatron-core's compiled dataset helpers (the CPU shim
``dataset_helpers``) against a token-by-token walk of the sample index, and the module's
worked example."""

from __future__ import annotations

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from te_paged.integrations.megatron import cpu_dataset_helpers as helpers


def walk(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, extra):
    """The sample index as helpers.cpp builds it: consume ``seq_length + extra`` tokens per
    sample, document by document, stepping back ``extra`` tokens for the next sample."""
    tokens = num_epochs * tokens_per_epoch - extra
    num_samples = tokens // seq_length if drop_last else -(-tokens // seq_length)
    rows = [(0, 0)]
    doc, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + extra
        while remaining:
            left = int(sizes[document_idx[doc]]) - offset
            remaining -= left
            if remaining <= 0:
                offset += remaining + left - extra
                remaining = 0
            elif doc == len(document_idx) - 1:
                offset = int(sizes[document_idx[doc]]) - extra
                break
            else:
                doc, offset = doc + 1, 0
        rows.append((doc, offset))
    return numpy.array(rows)


def test_the_worked_example() -> None:
    sizes = numpy.array([5, 3, 4], dtype=numpy.int32)
    idx = helpers.build_sample_idx_int32(sizes, numpy.arange(3), 4, 1, 12, True, 1)
    assert idx.tolist() == [[0, 0], [0, 4], [2, 0]] and idx.dtype == numpy.int32


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    seq_length=st.integers(2, 7),
    num_epochs=st.integers(1, 3),
    drop_last=st.booleans(),
    extra=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**16),
)
def test_sample_index_matches_the_token_walk(sizes, seq_length, num_epochs, drop_last, extra,
                                             seed) -> None:  # fmt: skip
    sizes = numpy.array(sizes, dtype=numpy.int32)
    tokens_per_epoch = int(sizes.sum())
    if tokens_per_epoch <= 1:
        return
    rng = numpy.random.default_rng(seed)
    document_idx = numpy.concatenate([rng.permutation(len(sizes)) for _ in range(num_epochs)])
    args = (sizes, document_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, extra)
    want = walk(*args)
    got = helpers.build_sample_idx_int64(*args)
    assert got.tolist() == want.tolist()


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="seq_length 1"):
        helpers.build_sample_idx_int64(numpy.array([4]), numpy.arange(1), 1, 1, 4)


def test_blending_follows_the_weights() -> None:
    index = numpy.zeros(8, dtype=numpy.int16)
    sample = numpy.zeros(8, dtype=numpy.int64)
    helpers.build_blending_indices(index, sample, numpy.array([0.75, 0.25]), 2, 8, False)
    assert index.tolist() == [0, 1, 0, 0, 0, 1, 0, 0]
    assert sample.tolist() == [0, 0, 1, 2, 3, 1, 4, 5]
