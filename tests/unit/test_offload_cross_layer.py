"""The offload engine over vLLM's cross-layer tensor: the host pool's blocks are cross-layer too, so a request's
store is one descriptor per block for every layer and starts only once every layer was saved; a load is each
block's range cut into runs of layers (``SLICES``), so its per-layer events complete in order, run by run."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from offload_fakes import GatedCpu

from kvplane.backend import get_backend
from kvplane.bench.local_copy import same_blocks
from kvplane.bench.offload import _zero_dst, build_rig, load_once, store_once
from kvplane.flows.offload.layer_plans import SLICES
from kvplane.kv.binding import slot_tensors

TOKENS = 64  # 4 blocks of 16


@pytest.mark.parametrize("model", ["qwen3-0.6b", "deepseek-v3"])
def test_a_cross_layer_request_stores_and_loads_byte_for_byte_in_one_descriptor_per_block(model: str) -> None:
    rig = build_rig(get_backend("cpu"), model, TOKENS, cross_layer=True)
    try:
        hashes = next(rig.prefixes)
        assert store_once(rig, "s", hashes) == len(rig.src_ids)
        assert rig.descriptors(hashes, "store") <= len(rig.src_ids)
        assert rig.descriptors(hashes, "load") <= SLICES * len(rig.src_ids)
        assert load_once(rig, "l", hashes) == TOKENS
        assert same_blocks(rig.spec, rig.cache, rig.src_ids, rig.cache, rig.dst_ids, rig.layouts)
    finally:
        rig.close()


def test_per_layer_caches_keep_one_descriptor_per_layer_and_block() -> None:
    rig = build_rig(get_backend("cpu"), "deepseek-v3", TOKENS)
    try:
        hashes = next(rig.prefixes)
        store_once(rig, "s", hashes)
        assert rig.descriptors(hashes, "store") == len(rig.src_ids) * len(rig.spec.layers)
    finally:
        rig.close()


def test_a_cross_layer_store_copies_nothing_until_its_last_layer_is_saved() -> None:
    rig = build_rig(get_backend("cpu"), "qwen3-0.6b", TOKENS, cross_layer=True)
    engine = rig.engine
    try:
        for buf in engine.pool.buffers.values():
            buf.zero_()
        engine.start_store("s", next(rig.prefixes), rig.src_ids)
        for name in rig.spec.layer_names[:-1]:
            engine.save_layer(name)
        engine.copier.save_stream.synchronize()
        assert all(not bool(buf.any()) for buf in engine.pool.buffers.values())  # nothing copied yet
        engine.save_layer(rig.spec.layer_names[-1])
        engine.wait_for_save()
        assert engine.get_finished()[0] == {"s"}
        host = torch.cat([b for b in engine.pool.buffers.values()])
        assert int(np.count_nonzero(host.numpy())) > 0
    finally:
        rig.close()


def _layer_loaded(rig: Any, layer: int) -> bool:
    slot = slot_tensors(rig.spec, rig.cache, rig.layouts)[layer].tensor.view(torch.uint8)  # bytes: no NaN != NaN
    src, dst = torch.from_numpy(rig.src_ids), torch.from_numpy(rig.dst_ids)
    return torch.equal(slot.index_select(0, src), slot.index_select(0, dst))


def test_a_cross_layer_load_completes_its_first_layers_while_later_layers_are_still_copying() -> None:
    backend = GatedCpu()
    rig = build_rig(backend, "deepseek-v3", TOKENS, cross_layer=True)
    engine = rig.engine
    try:
        hashes = next(rig.prefixes)
        store_once(rig, "s", hashes)
        _zero_dst(rig)
        gate = backend.gate(backend.calls + 1)  # the load's second run of layers waits here
        engine.start_load("l", hashes, rig.dst_ids)
        engine.wait_for_layer(rig.spec.layer_names[0])  # returns: layer 0 is in the first run
        assert _layer_loaded(rig, 0)
        assert not _layer_loaded(rig, len(rig.spec.layers) - 1)  # its run has not been copied yet
        gate.set()
        for name in rig.spec.layer_names:
            engine.wait_for_layer(name)
        assert engine.get_finished()[1] == {"l"}
        assert same_blocks(rig.spec, rig.cache, rig.src_ids, rig.cache, rig.dst_ids, rig.layouts)
    finally:
        gate.set()
        rig.close()
