"""The key scheme and the hit policies on their own: what makes two pages share a key, and which prefix lengths
each policy lets a side pool restore."""

from __future__ import annotations

import numpy as np
import pytest

from kvplane.integrations.sglang.hits import ALL_PAGES, TRAILING_PAGES, longest, restorable
from kvplane.integrations.sglang.keys import Shard, key_prefix, page_keys, pool_format

FOUND = np.array([1, 0, 1, 1, 0, 1], dtype=bool)


@pytest.mark.parametrize("policy, trailing, allowed", [
    (ALL_PAGES, 1, [1, 0, 0, 0, 0, 0]),
    (TRAILING_PAGES, 1, [1, 0, 1, 1, 0, 1]),
    (TRAILING_PAGES, 2, [1, 0, 0, 1, 0, 0]),  # a window is cut at the span's start (hicache_storage.py)
    (TRAILING_PAGES, 9, [1, 0, 0, 0, 0, 0]),
])
def test_each_policy_allows_the_prefix_lengths_sglang_documents(policy: str, trailing: int,
                                                                 allowed: list[int]) -> None:
    mask = restorable(policy, FOUND, 6, trailing)
    assert mask is not None and mask.tolist() == [bool(a) for a in allowed]
    assert longest(mask) == (max(i + 1 for i, a in enumerate(allowed) if a) if any(allowed) else 0)


def test_a_policy_the_backend_does_not_serve_has_no_mask_and_short_answers_count_as_missing() -> None:
    assert restorable("block_groups", FOUND, 6) is None
    mask = restorable(ALL_PAGES, np.ones(2, dtype=bool), 4)
    assert mask is not None and mask.tolist() == [True, True, False, False]


def test_keys_name_the_namespace_model_shard_pool_and_format() -> None:
    shard = Shard(model="org/m", tp_size=4, tp_rank=3, pp_size=2, pp_rank=1)
    fmt = pool_format("page_first", "torch.bfloat16", [384, 384])
    prefix = key_prefix("ns", shard, False, "kv", fmt)
    assert prefix == f"ns/org%2Fm/tp4-r3-pp2.1/kv.{fmt}/"
    assert key_prefix("ns", shard, True, "kv", fmt) == f"ns/org%2Fm/mla-pp2.1/kv.{fmt}/"
    assert page_keys(prefix, ["aa", "bb"], 2) == [f"{prefix}aa/0", f"{prefix}aa/1", f"{prefix}bb/0", f"{prefix}bb/1"]
    # a model named with '/' never meets one named with '-' or '%2F' spelt out
    assert len({key_prefix("ns", Shard(m, 1, 0), False, "kv", fmt) for m in ("a/b", "a-b", "a%2Fb")}) == 3
    assert len({pool_format(lay, dt, sizes) for lay, dt, sizes in [
        ("page_first", "torch.bfloat16", [384, 384]), ("page_first_direct", "torch.bfloat16", [384, 384]),
        ("page_first", "torch.float16", [384, 384]), ("page_first", "torch.bfloat16", [768])]}) == 4
