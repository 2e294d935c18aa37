"""The ranks of one prefill instance must store their KV alike: a check a decode rank runs before it plans a pull.

A pull decides once per layer, for every prefill rank it reads from, whether that layer's bytes land directly
in the decode's blocks or are staged and re-laid out (``decode_start.Starter``): ranks that send heads of one
layer into the same destination blocks must all do the one or all the other, or a re-layout rewriting a block
could race a direct READ into it. The decision depends on how each rank stores its KV, so the ranks' manifests
must agree on it: their ``tp_size``, their layouts and, per layer, the shape of its blocks (tokens per block,
heads, row and block bytes, token- or head-major order, the slots a row holds). Where the blocks live
(addresses, block counts, strides) may differ. Each rank's manifest was already checked against this rank's
model at its handshake (``kv.manifest.check_compatible``).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvplane.descriptors import Region
from kvplane.flows.disagg.wire.errors import DisaggError
from kvplane.kv.manifest import Manifest

FIX = ("every rank of a prefill instance must use the same KV layout, block order and block size (a pull "
       "decides per layer, for all of them at once, whether to stage it): start its ranks with the same KV-cache "
       "settings")


def _storage(region: Region) -> dict[str, object]:
    return {"tokens_per_block": region.tokens_per_block, "heads": region.heads, "row_bytes": region.row_bytes,
            "block_bytes": region.block_bytes, "order": region.order,
            "parts": tuple((part.slot, part.offset, part.nbytes) for part in region.parts)}


def _fields(manifest: Manifest) -> dict[str, object]:
    out: dict[str, object] = {"tp_size": manifest.tp_size, "layouts": dict(sorted(manifest.layouts.items()))}
    for layer in manifest.spec.layers:
        out[f"regions[{layer.name!r}]"] = [_storage(r) for r in manifest.regions_of(layer.name)]
    return out


def check_alike(engine_id: str, manifests: Mapping[int, Manifest]) -> None:
    """Raise ``DisaggError`` naming the first field in which a prefill rank's manifest differs from the lowest
    rank's, with both values and the fix."""
    if len(manifests) < 2:
        return
    first, *others = sorted(manifests)
    expected = _fields(manifests[first])
    for rank in others:
        for field, value in _fields(manifests[rank]).items():
            if value != expected.get(field):
                raise DisaggError(
                    f"prefill ranks of {engine_id!r} differ in manifest field {field}: rank {first}="
                    f"{expected.get(field)!r}, rank {rank}={value!r}; {FIX}"
                )
