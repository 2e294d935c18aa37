"""Host and device memory: sizes, dtypes, where it lives, pinning for DMA, and refused sizes."""

from __future__ import annotations

import pytest

from kvplane.backend.base import Backend
from kvplane.errors import BackendError

MiB = 1 << 20


def test_host_memory_is_a_writable_uint8_cpu_tensor_of_the_size_asked(kvplane_backend: Backend) -> None:
    import torch

    for pinned in (True, False):
        buf = kvplane_backend.alloc_host(MiB + 3, pinned=pinned)
        assert buf.dtype == torch.uint8 and buf.shape == (MiB + 3,) and buf.device.type == "cpu"
        buf.fill_(7)
        assert int(buf[-1]) == 7


def test_device_memory_lives_on_the_backends_device(kvplane_backend: Backend) -> None:
    import torch

    buf = kvplane_backend.alloc_device(MiB)
    assert buf.dtype == torch.uint8 and buf.numel() == MiB
    assert buf.device.type == kvplane_backend.device().type


def test_host_memory_is_pinned_for_dma(kvplane_backend: Backend) -> None:
    if kvplane_backend.device().type == "cpu":
        pytest.skip(f"{kvplane_backend.label}: device memory is host memory here, so there is nothing to pin")
    assert kvplane_backend.alloc_host(MiB).is_pinned()
    assert not kvplane_backend.alloc_host(MiB, pinned=False).is_pinned()


@pytest.mark.parametrize("nbytes", [0, -1])
def test_sizes_below_one_byte_are_refused_naming_the_size(kvplane_backend: Backend, nbytes: int) -> None:
    with pytest.raises(BackendError, match=rf"nbytes={nbytes} must be > 0"):
        kvplane_backend.alloc_host(nbytes)
    with pytest.raises(BackendError, match=rf"nbytes={nbytes} must be > 0"):
        kvplane_backend.alloc_device(nbytes)
