"""Where a batch of SGLang pages lies in host memory: the host pool's own pointers, as arrays.

``page_spans`` checks the host indices SGLang passed against the keys (one page of ``page_size`` consecutive,
page-aligned slots inside the pool per key) and asks the pool itself for the page buffers
(``get_page_buffer_meta``, the call SGLang's own zero-copy backends use), so the addresses and sizes are
SGLang's, in every host layout. A batch that does not fit is refused with the reason, never moved. The arrays
are ``(pages, parts)``: part ``i`` of a page is its ``i``-th buffer in the pool's order (``keys.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

Int64s = npt.NDArray[np.int64]


class HostPool(Protocol):
    """What the backend reads of an SGLang host pool (``mem_cache/pool_host/base.py`` ``HostKVCache``)."""

    page_size: int
    size: int
    layout: str
    dtype: Any

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[Any], list[Any]]: ...


@dataclass(frozen=True)
class PageSpans:
    """Host ranges of a batch of pages, ``(pages, parts)`` each."""

    addrs: Int64s
    sizes: Int64s

    @property
    def parts(self) -> int:
        return int(self.addrs.shape[1])


def index_problem(pool: HostPool, host_indices: Any, pages: int) -> str:
    """Why ``host_indices`` cannot hold ``pages`` pages of ``pool``, or "" when they can."""
    idx = np.asarray(host_indices.detach().cpu() if hasattr(host_indices, "detach") else host_indices)
    size = pool.page_size
    if idx.ndim != 1 or idx.size != pages * size:
        return (f"{idx.size} host indices for {pages} key(s) of {size} tokens a page; SGLang passes "
                f"len(keys) * page_size = {pages * size}")
    if pages == 0:
        return ""
    rows = idx.reshape(pages, size).astype(np.int64)
    first = rows[:, 0]
    if (first % size).any() or (rows != first[:, None] + np.arange(size)).any():
        return "the host indices are not whole pages (page_size consecutive slots from a multiple of page_size)"
    if first.min() < 0 or first.max() + size > pool.size:
        return f"host indices {int(first.min())}..{int(first.max()) + size - 1} fall outside the pool's {pool.size}"
    return ""


def page_spans(pool: HostPool, host_indices: Any, pages: int) -> PageSpans | str:
    """The host ranges of ``pages`` pages at ``host_indices``, or why there are none (see ``index_problem``)."""
    problem = index_problem(pool, host_indices, pages)
    if problem:
        return problem
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    if pages == 0 or not ptrs or len(ptrs) != len(sizes) or len(ptrs) % pages:
        return f"the host pool listed {len(ptrs)} buffer(s) for {pages} page(s)"
    if not isinstance(ptrs[0], (int, np.integer)):  # grouped lists (multi-buffer objects): not this backend's
        return f"the host pool lists grouped buffers ({type(ptrs[0]).__name__}) that the kvplane backend cannot key"
    addrs = np.asarray(ptrs, dtype=np.int64).reshape(pages, -1)
    return PageSpans(addrs, np.asarray(sizes, dtype=np.int64).reshape(pages, -1))


def part_bytes(pool: HostPool) -> list[int]:
    """The bytes of each part of one page of ``pool`` (the same for every page)."""
    import torch  # the host pool's own call takes a torch index tensor

    _, sizes = pool.get_page_buffer_meta(torch.arange(pool.page_size, dtype=torch.int64))
    return [int(s) for s in sizes]


def inside(ranges: list[tuple[int, int]], spans: PageSpans) -> bool:
    """Whether every span lies inside one of ``ranges`` (``(start, nbytes)``, disjoint)."""
    if not ranges:
        return False
    ordered = sorted(ranges)
    starts = np.array([s for s, _ in ordered], dtype=np.int64)
    ends = starts + np.array([n for _, n in ordered], dtype=np.int64)
    addrs, last = spans.addrs.ravel(), (spans.addrs + spans.sizes).ravel()
    at = np.searchsorted(starts, addrs, side="right") - 1
    return bool((at >= 0).all() and (last <= ends[np.maximum(at, 0)]).all())
