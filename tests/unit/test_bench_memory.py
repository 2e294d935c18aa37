"""The bench keeps freed memory in its process while rows run, so a row reuses pages an earlier row touched."""

from __future__ import annotations

import resource

import pytest
import torch

from kvplane.bench.memory import freed_memory_kept

MIB = 1 << 20


def _faults_of_touching(nbytes: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = torch.empty(nbytes, dtype=torch.uint8)  # as the bench allocates (numpy would ask for huge pages)
    buf.fill_(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del buf
    return faults


def test_memory_a_row_freed_inside_the_block_serves_the_next_rows_smaller_buffer_without_faulting_again() -> None:
    pages = 32 * MIB // resource.getpagesize()
    with freed_memory_kept() as kept:
        if not kept:
            pytest.skip("the C library is not glibc: there is no mallopt to keep freed memory with")
        _faults_of_touching(64 * MIB)
        again = _faults_of_touching(32 * MIB)
    assert again < pages // 4, f"{again} page faults touching a 32 MiB buffer in freed memory ({pages} pages)"


def test_outside_the_block_freed_memory_goes_back_to_the_kernel_as_glibc_does_by_default() -> None:
    pages = 32 * MIB // resource.getpagesize()
    with freed_memory_kept():
        pass
    _faults_of_touching(64 * MIB)
    again = _faults_of_touching(32 * MIB)
    assert again > pages // 2, f"only {again} page faults touching a fresh 32 MiB buffer ({pages} pages)"
