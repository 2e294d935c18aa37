"""The manifest of one rank: identity, KV spec, layouts and regions, plus a compatibility fingerprint.

Peers exchange manifests at handshake (msgpack through msgspec; never pickle) and validate them before any
byte moves. ``check_compatible`` raises ``ManifestMismatch`` naming the field and both sides' values.
Fields that may legitimately differ (rank, TP size, block size, layout) are left to the planner.
"""

from __future__ import annotations

import hashlib

import msgspec

from kvplane import __version__
from kvplane.descriptors import Region
from kvplane.errors import ManifestDecodeError, ManifestMismatch
from kvplane.kv.spec import KVSpec

MAX_MANIFEST_BYTES = 64 * 1024 * 1024


class Manifest(msgspec.Struct, frozen=True):
    engine_id: str
    rank: int
    tp_size: int
    device_type: str  # the backend's label: cuda, npu, cpu, npu-emulated (what errors name the rank's device by)
    spec: KVSpec
    layouts: dict[str, str]  # family -> layout name
    regions: tuple[Region, ...]
    kvplane_version: str = __version__

    @property
    def dtype(self) -> str:
        return self.spec.layers[0].slots[0].dtype

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(sorted({layer.family for layer in self.spec.layers}))

    def compatibility(self) -> dict[str, object]:
        """What must agree between two ranks for KV to move between them, rank- and TP-independently."""
        layers = []
        for layer in self.spec.layers:
            layers.append(
                (
                    layer.name,
                    layer.group_id,
                    tuple((s.name, s.heads * (self.tp_size if layer.family == "gqa" else 1), s.head_dim, s.dtype)
                          for s in layer.slots),
                )
            )
        return {
            "kvplane_version": self.kvplane_version.split("+")[0].rsplit(".", 1)[0],
            "families": self.families,
            "num_layers": len(self.spec.layers),
            "groups": tuple(g.group_id for g in self.spec.groups),
            "layers": tuple(layers),
        }

    @property
    def fingerprint(self) -> str:
        """A short hash of ``compatibility()``: equal fingerprints mean compatible model shapes."""
        blob = msgspec.msgpack.encode(self.compatibility())
        return hashlib.blake2b(blob, digest_size=8).hexdigest()

    def regions_of(self, layer_name: str) -> list[Region]:
        return [r for r in self.regions if r.layer_name == layer_name]

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestDecodeError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}; refusing it")
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except (msgspec.MsgspecError, ValueError) as e:  # ValueError: invalid UTF-8 in a string field
            raise ManifestDecodeError(f"bytes do not hold a kvplane manifest: {e}") from None


_FIXES = {
    "kvplane_version": "run the same kvplane minor version on both sides",
    "families": "both sides must serve the same model (GQA vs MLA)",
    "num_layers": "both sides must serve the same model",
    "groups": "both sides must use the same KV-cache groups (same model, same hybrid config)",
    "layers": "both sides must serve the same model with the same dtype and head sizes",
}


def check_compatible(local: Manifest, remote: Manifest) -> None:
    """Raise ``ManifestMismatch`` for the first field that differs; the message names both values."""
    if local.dtype != remote.dtype:
        raise ManifestMismatch("dtype", local.dtype, remote.dtype, "load the model with the same dtype on both sides")
    mine, theirs = local.compatibility(), remote.compatibility()
    for field, value in mine.items():
        other = theirs[field]
        if value == other:
            continue
        if field == "layers":
            for a, b in zip(value, other):  # type: ignore[call-overload]
                if a != b:
                    raise ManifestMismatch(f"layers[{a[0]!r}]", a, b, _FIXES[field])
        raise ManifestMismatch(field, value, other, _FIXES[field])
