"""vllm-ascend's KV caches as the CPU builder in ``vllm_ascend_shapes`` makes them: the table is checked against the
vllm-ascend source itself when one is given (``VLLM_ASCEND_SRC=/path/to/unpacked/tree``, the directory holding
``vllm_ascend/``), and the one backend module that imports without torch_npu is called for real."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import vllm_ascend_shapes as vas

BY_ID = {b.id: b for b in vas.ASCEND_BACKENDS}
SRC = os.environ.get("VLLM_ASCEND_SRC")
needs_source = pytest.mark.skipif(
    not SRC, reason="set VLLM_ASCEND_SRC to a vllm-ascend source tree (git archive of SOURCE_COMMIT) to check the table"
)


def test_gqa_layers_hand_over_k_and_v_as_two_2mib_aligned_allocations() -> None:
    k, v = vas.ascend_kv_caches(BY_ID["attention.attention_v1.AscendAttentionBackend"], 5, heads=4, head_size=128)
    assert k.shape == v.shape == (5, 128, 4, 128)
    assert k.is_contiguous() and v.is_contiguous()
    assert k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
    for t in (k, v):
        assert t.data_ptr() % vas.ALIGNMENT == 0
        # a view of a larger allocation (2 MiB extra), as vllm-ascend hands it to connectors
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size() + vas.ALIGNMENT


def test_mla_layers_hand_over_nope_and_rope_allocations() -> None:
    nope, rope = vas.ascend_kv_caches(BY_ID["attention.mla_v1.AscendMLABackend"], 3)
    assert nope.shape == (3, 128, 1, 512) and rope.shape == (3, 128, 1, 64)
    assert nope.dtype == rope.dtype == torch.bfloat16
    assert nope.untyped_storage().data_ptr() != rope.untyped_storage().data_ptr()


def test_indexer_k_and_scale_share_one_allocation() -> None:
    backend = BY_ID["attention.indexer.AscendSFAIndexerBackend"]
    (k,) = vas.ascend_kv_caches(backend, 3, head_size=128, dtype=torch.int8)
    assert k.shape == (3, 128, 1, 128)
    k, scale = vas.ascend_kv_caches(backend, 3, head_size=128, dtype=torch.int8, scale_dim=1)
    assert scale.shape == (3, 128, 1, 1) and scale.dtype == torch.float32
    assert k.untyped_storage().data_ptr() == scale.untyped_storage().data_ptr()
    assert scale.data_ptr() - k.data_ptr() == 3 * 128 * 128  # scale follows k, 4-byte aligned


@pytest.mark.parametrize("backend_id", [b.id for b in vas.ASCEND_BACKENDS
                                        if b.handed in (vas.NPU_FORMAT, vas.STRIDED_PAGES)])
def test_no_host_layout_is_invented_for_npu_private_formats(backend_id: str) -> None:
    with pytest.raises(ValueError, match=backend_id):
        vas.ascend_kv_caches(BY_ID[backend_id], 2)


@needs_source
@pytest.mark.parametrize("backend", vas.ASCEND_BACKENDS, ids=[b.id for b in vas.ASCEND_BACKENDS])
def test_table_entry_points_at_the_function_it_transcribes(backend: vas.AscendBackend) -> None:
    assert SRC is not None
    path, line = backend.source.split(" ", 1)[0].split(":")
    lines = (Path(SRC) / path).read_text().splitlines()
    assert "def get_kv_cache_shape" in lines[int(line) - 1], (path, line)
    class_line = max(i for i, text in enumerate(lines[: int(line)]) if text.startswith("class "))
    assert re.match(rf"class {backend.qualname}\b", lines[class_line]), lines[class_line]


@needs_source
def test_indexer_shape_is_vllm_ascends_own_function() -> None:
    """``vllm_ascend/attention/indexer.py`` imports without torch_npu: call it in a child process (importing
    vllm_ascend patches vLLM, which must not leak into this process)."""
    pytest.importorskip("vllm", reason="vllm_ascend imports vLLM")
    backend = BY_ID["attention.indexer.AscendSFAIndexerBackend"]
    params = [(4, 128, 1, 128), (2, 64, 1, 132), (3, 128, 2, 64)]
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {SRC!r})\n"
        "from vllm_ascend.attention.indexer import AscendSFAIndexerBackend as B\n"
        f"print(json.dumps([list(B.get_kv_cache_shape(*p)) for p in {params!r}] + [B.get_name()]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    *shapes, name = json.loads(out.stdout.strip().splitlines()[-1])
    assert name == backend.name
    assert [tuple(s) for s in shapes] == [backend.shape(*p) for p in params]
