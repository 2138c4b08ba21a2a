"""numpy versions of megatron-core's compiled dataset helpers, for CPU test runs only.

megatron-core's ``megatron/core/datasets/helpers_cpp`` is a pybind11 extension that its wheel
ships compiled for one interpreter (0.19.2: CPython 3.12 only, and no Makefile to rebuild it).
te_paged's tests run Megatron-LM's training loop on Python 3.11 with mock data, whose
``GPTDataset`` builds its sample index with ``build_sample_idx_int32``/``_int64`` (and a blend
with ``build_blending_indices``). :func:`te_paged.integrations.megatron.cpu_shims.install`
registers this module under the extension's name when the extension does not import
(``dataset_helpers`` in its table); nothing else imports it.

Sample index, worked example: documents of 5, 3 and 4 tokens (in ``document_idx`` order),
``seq_length = 4``, one extra token per sample (the label shift): sample ``i`` starts at token
``4 i`` of the concatenated stream and takes 5 tokens, so consecutive samples share one. Token
0 is (document 0, offset 0), token 4 is (document 0, offset 4), token 8 is (document 2,
offset 0): ``[[0, 0], [0, 4], [2, 0]]`` for the ``(12 - 1) // 4 = 2`` samples (row ``i`` is
where sample ``i`` starts, the last row where the last sample's extra token ends).
"""

from __future__ import annotations

import numpy

__all__ = ["build_blending_indices", "build_sample_idx_int32", "build_sample_idx_int64"]


def _build_sample_idx(
    dtype: type,
    sizes: numpy.ndarray,
    document_idx: numpy.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: int = 1,
) -> numpy.ndarray:
    """``[num_samples + 1, 2]`` rows ``(position in document_idx, token offset)`` of each
    sample's first token (see the module's example)."""
    if seq_length <= 1 or num_epochs <= 0 or tokens_per_epoch <= 1:
        raise ValueError(
            f"seq_length {seq_length}, num_epochs {num_epochs}, tokens_per_epoch "
            f"{tokens_per_epoch}: each must be positive (seq_length and tokens above 1)"
        )
    extra = int(add_extra_token_to_sequence)
    tokens = num_epochs * tokens_per_epoch - extra
    num_samples = tokens // seq_length if drop_last_partial_sequence else -(-tokens // seq_length)
    lengths = numpy.asarray(sizes, dtype=numpy.int64)[numpy.asarray(document_idx)]
    ends = numpy.cumsum(lengths)  # ends[d]: one past document d's last token
    starts = numpy.arange(num_samples + 1, dtype=numpy.int64) * seq_length
    # The document holding the token before each start (or the start itself with the extra
    # token): a sample ending exactly at a document's end starts the next in that document.
    anchor = numpy.maximum(starts + extra - 1, 0)
    doc = numpy.minimum(numpy.searchsorted(ends, anchor, side="right"), len(lengths) - 1)
    first = ends[doc] - lengths[doc]
    offset = starts - first
    # Past the last token (a partial last sample kept): the last document's end.
    past = anchor >= ends[-1]
    offset[past] = lengths[-1] - extra
    doc[0], offset[0] = 0, 0
    return numpy.stack([doc, offset], axis=1).astype(dtype)


def build_sample_idx_int32(*args: object, **kwargs: object) -> numpy.ndarray:
    return _build_sample_idx(numpy.int32, *args, **kwargs)


def build_sample_idx_int64(*args: object, **kwargs: object) -> numpy.ndarray:
    return _build_sample_idx(numpy.int64, *args, **kwargs)


def build_blending_indices(
    dataset_index: numpy.ndarray,
    dataset_sample_index: numpy.ndarray,
    weights: numpy.ndarray,
    num_datasets: int,
    size: int,
    verbose: bool,
) -> None:
    """Fill ``dataset_index[i]`` and ``dataset_sample_index[i]`` for ``i < size``: each sample
    comes from the dataset furthest below its share ``weights[d] * i`` so far (ties: the
    lowest index), and is that dataset's next sample."""
    taken = [0] * num_datasets
    for i in range(size):
        seen = max(float(i), 1.0)
        best = max(range(num_datasets), key=lambda d: weights[d] * seen - taken[d])
        dataset_index[i] = best
        dataset_sample_index[i] = taken[best]
        taken[best] += 1
