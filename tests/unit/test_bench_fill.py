"""The offload rig's fill pattern: every int64 word distinct, so a misplaced block never compares equal."""

from __future__ import annotations

import pytest
import torch

from kvplane.bench.offload import FILL_FACTOR, fill_distinct


def test_the_one_pass_fill_writes_word_i_as_i_times_the_factor_across_row_boundaries() -> None:
    buf = torch.empty(8 * 6 * 7, dtype=torch.uint8)
    fill_distinct(buf, 7)
    words = buf.view(torch.int64)
    assert torch.equal(words, torch.arange(words.numel(), dtype=torch.int64) * FILL_FACTOR)
    assert words.unique().numel() == words.numel()


def test_a_row_length_that_does_not_divide_the_buffer_is_refused_naming_both_sizes() -> None:
    with pytest.raises(ValueError, match="row_words=5 must divide the buffer's 42 words"):
        fill_distinct(torch.empty(8 * 42, dtype=torch.uint8), 5)
