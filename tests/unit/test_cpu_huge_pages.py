"""The cpu backend asks for transparent huge pages on its big buffers (``kvplane/backend/cpu/huge_pages.py``)."""

from __future__ import annotations

import pytest

from kvplane.backend.cpu import huge_pages
from kvplane.backend.cpu.backend import CpuBackend

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_available() -> bool:
    try:
        with open(THP) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping that holds ``addr`` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


needs_thp = pytest.mark.skipif(not _thp_available(), reason=f"this kernel has no transparent huge pages ({THP})")


@needs_thp
@pytest.mark.parametrize("alloc", ["alloc_host", "alloc_device"])
def test_a_big_buffer_is_advised_huge_pages_over_its_aligned_inside(alloc: str) -> None:
    backend = CpuBackend()
    buf = getattr(backend, alloc)(64 << 20)
    inside = -(-buf.data_ptr() // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE
    assert "hg" in _vm_flags(inside)  # hg: madvise(MADV_HUGEPAGE) covers this mapping


@needs_thp
def test_a_big_buffer_starts_on_a_huge_page_and_is_advised_whole() -> None:
    buf = huge_pages.alloc((16 << 20) + 12345, 8 << 20)
    assert buf is not None and buf.numel() == (16 << 20) + 12345
    assert buf.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert "hg" in _vm_flags(buf.data_ptr()) and "hg" in _vm_flags(buf.data_ptr() + buf.numel() - 1)


def test_a_small_buffer_is_left_to_the_caller() -> None:
    assert huge_pages.alloc(1 << 20, 8 << 20) is None
    assert huge_pages.alloc(16 << 20, 32 << 20) is None
    assert CpuBackend().alloc_host(1 << 20).numel() == 1 << 20

FREED = """
import sys, torch
from kvplane.backend.cpu.backend import CpuBackend
sys.path.insert(0, {here!r})
from test_cpu_huge_pages import _vm_flags
big = torch.empty(24 << 20, dtype=torch.uint8)
del big  # glibc now serves allocations under 24 MiB from its heap (its mmap threshold follows frees)
buf = getattr(CpuBackend(), {alloc!r})(16 << 20)
addr = buf.data_ptr() + (4 << 20)
assert "hg" in _vm_flags(addr)
del buf
try:
    print(" ".join(_vm_flags(addr)))
except AssertionError:  # unmapped with the buffer
    print("unmapped")
"""


@needs_thp
@pytest.mark.parametrize("alloc", ["alloc_host", "alloc_device"])
def test_the_advice_goes_with_the_buffer_and_never_stays_on_memory_the_process_reuses(alloc: str) -> None:
    """A freed buffer's pages must not stay advised: malloc would hand them to small allocations as 2 MiB pages."""
    import os
    import subprocess
    import sys

    code = FREED.format(here=os.path.dirname(__file__), alloc=alloc)  # a fresh process: glibc's heap as it starts
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "hg" not in out, f"freed memory still advised huge pages: VmFlags {out}"
