"""Manifests: msgpack round trip, fingerprints that ignore rank and TP, and mismatches named field by field."""

from __future__ import annotations

import pickle

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplane.kv.manifest as manifest_module
from kvplane.errors import KvplaneError, ManifestDecodeError, ManifestMismatch
from kvplane.kv.binding import allocate_cache, layouts_by_family, regions_from_tensors
from kvplane.kv.manifest import Manifest, check_compatible
from kvplane.kv.spec import KVSpec

NB = 4


def manifest(
    spec: KVSpec,
    layout: str,
    *,
    rank: int = 0,
    tp_size: int = 1,
    engine_id: str = "prefill-0",
    device_type: str = "cpu",
    version: str | None = None,
) -> Manifest:
    regions = regions_from_tensors(spec, allocate_cache(spec, layout, NB), layout)
    families = {family: lay.name for family, lay in layouts_by_family(layout).items()}
    extra = {} if version is None else {"kvplane_version": version}
    return Manifest(engine_id, rank, tp_size, device_type, spec, families, tuple(regions), **extra)


def gqa(heads: int = 8, head_dim: int = 16, layers: int = 2, dtype: str = "bfloat16", **kw: object) -> KVSpec:
    return KVSpec.gqa(layers, heads, head_dim, dtype=dtype, tokens_per_block=4, **kw)  # type: ignore[arg-type]


def mla(layers: int = 2, dtype: str = "bfloat16", tokens_per_block: int = 4) -> KVSpec:
    return KVSpec.mla(layers, kv_lora_rank=32, rope_dim=8, dtype=dtype, tokens_per_block=tokens_per_block)


def hybrid() -> KVSpec:
    return gqa(layers=4, layer_groups=[0, 1, 0, 1], group_tokens_per_block={1: 8})


# -- round trip ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, layout",
    [
        (gqa(), "packed_kv"),
        (gqa(), "kv_first"),
        (mla(), "mla_fused"),
        (mla(), "mla_split"),
        (hybrid(), "split_kv"),
    ],
    ids=["packed_kv", "kv_first", "mla_fused", "mla_split", "hybrid"],
)
def test_encode_then_decode_gives_an_equal_manifest_with_the_same_fingerprint(
    spec: KVSpec, layout: str
) -> None:
    m = manifest(spec, layout, rank=3, tp_size=4, engine_id="decode-7")
    back = Manifest.decode(m.encode())
    assert back == m
    assert back.fingerprint == m.fingerprint
    assert back.regions == m.regions
    assert back.spec.groups == m.spec.groups


def test_the_wire_format_is_msgpack_and_never_touches_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_: object, **__: object) -> None:
        raise AssertionError("pickle was used")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, forbidden)
    m = manifest(gqa(), "packed_kv")
    data = m.encode()
    assert not data.startswith(b"\x80")  # every pickle protocol >= 2 opens with PROTO
    plain = msgspec.msgpack.decode(data)  # a plain msgpack map, readable without kvplane
    assert plain["engine_id"] == "prefill-0" and plain["tp_size"] == 1
    assert Manifest.decode(data) == m


def test_regions_of_returns_a_layers_regions_in_slot_order() -> None:
    m = manifest(gqa(), "split_kv")
    assert [(r.layer_name, r.slot) for r in m.regions_of("layers.1")] == [
        ("layers.1", "k"),
        ("layers.1", "v"),
    ]
    assert m.regions_of("no.such.layer") == []


# -- fingerprint ---------------------------------------------------------------------------------------------
def test_fingerprint_ignores_rank_engine_device_and_layout() -> None:
    a = manifest(gqa(), "packed_kv", rank=0, engine_id="prefill-0", device_type="cuda")
    b = manifest(gqa(), "split_kv", rank=5, engine_id="decode-3", device_type="npu")
    assert a.fingerprint == b.fingerprint
    check_compatible(a, b)


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_fingerprint_is_equal_across_tp_sizes_when_heads_times_tp_is_equal(tp_size: int) -> None:
    whole = manifest(gqa(heads=8), "packed_kv", tp_size=1)
    sliced = manifest(gqa(heads=8 // tp_size), "packed_kv", tp_size=tp_size, rank=tp_size - 1)
    assert sliced.fingerprint == whole.fingerprint
    check_compatible(whole, sliced)
    check_compatible(sliced, whole)


def test_mla_is_replicated_so_its_fingerprint_ignores_tp() -> None:
    assert (
        manifest(mla(), "mla_fused", tp_size=1).fingerprint
        == manifest(mla(), "mla_split", tp_size=8).fingerprint
    )


def test_block_size_may_differ_between_compatible_sides() -> None:
    check_compatible(
        manifest(mla(tokens_per_block=4), "mla_fused"), manifest(mla(tokens_per_block=16), "mla_fused")
    )


def test_fingerprint_differs_between_different_models() -> None:
    prints = {
        manifest(gqa(), "packed_kv").fingerprint,
        manifest(gqa(head_dim=32), "packed_kv").fingerprint,
        manifest(gqa(layers=3), "packed_kv").fingerprint,
        manifest(gqa(dtype="float16"), "packed_kv").fingerprint,
        manifest(mla(), "mla_fused").fingerprint,
        manifest(hybrid(), "packed_kv").fingerprint,
    }
    assert len(prints) == 6
    assert all(isinstance(p, str) and len(p) == 16 for p in prints)


def test_a_patch_release_apart_is_compatible_a_minor_release_is_not() -> None:
    base = manifest(gqa(), "packed_kv", version="0.3.1")
    check_compatible(base, manifest(gqa(), "packed_kv", version="0.3.7+local"))
    with pytest.raises(
        ManifestMismatch, match=r"'kvplane_version' differs: local='0\.3', remote='0\.4'"
    ) as info:
        check_compatible(base, manifest(gqa(), "packed_kv", version="0.4.0"))
    assert "same kvplane minor version" in str(info.value)


# -- mismatches ----------------------------------------------------------------------------------------------
def test_a_dtype_mismatch_names_the_field_and_both_dtypes() -> None:
    local, remote = manifest(gqa(), "packed_kv"), manifest(gqa(dtype="float16"), "packed_kv")
    with pytest.raises(
        ManifestMismatch, match=r"'dtype' differs: local='bfloat16', remote='float16'"
    ) as info:
        check_compatible(local, remote)
    assert (info.value.field, info.value.local, info.value.remote) == ("dtype", "bfloat16", "float16")
    assert "same dtype" in str(info.value)


def test_gqa_against_mla_names_the_families() -> None:
    with pytest.raises(
        ManifestMismatch, match=r"'families' differs: local=\('gqa',\), remote=\('mla',\)"
    ) as info:
        check_compatible(manifest(gqa(), "packed_kv"), manifest(mla(), "mla_fused"))
    assert info.value.field == "families"
    assert "GQA vs MLA" in str(info.value)


def test_a_layer_count_mismatch_names_both_counts() -> None:
    with pytest.raises(ManifestMismatch, match=r"'num_layers' differs: local=2, remote=3") as info:
        check_compatible(manifest(gqa(), "packed_kv"), manifest(gqa(layers=3), "packed_kv"))
    assert (info.value.local, info.value.remote) == (2, 3)


def test_a_head_dim_mismatch_names_the_layer_and_both_head_dims() -> None:
    local, remote = manifest(gqa(head_dim=96), "split_kv"), manifest(gqa(head_dim=112), "split_kv")
    with pytest.raises(ManifestMismatch, match=r"layers\.0") as info:
        check_compatible(local, remote)
    message = str(info.value)
    assert "96" in message and "112" in message
    assert "local=" in message and "remote=" in message
    assert info.value.local != info.value.remote


def test_total_heads_that_differ_across_tp_are_a_mismatch() -> None:
    # 8 heads on each of 2 ranks is a 16-head model; it cannot exchange KV with an 8-head model.
    with pytest.raises(ManifestMismatch, match=r"layers\.0"):
        check_compatible(manifest(gqa(heads=8), "packed_kv", tp_size=2), manifest(gqa(heads=8), "packed_kv"))


def test_hybrid_against_single_group_names_the_groups() -> None:
    one_group = gqa(layers=4)
    with pytest.raises(ManifestMismatch, match=r"'groups' differs: local=\(0, 1\), remote=\(0,\)"):
        check_compatible(manifest(hybrid(), "packed_kv"), manifest(one_group, "packed_kv"))


def test_a_mismatch_is_a_value_error_and_a_kvplane_error() -> None:
    with pytest.raises(ManifestMismatch) as info:
        check_compatible(manifest(gqa(), "packed_kv"), manifest(mla(), "mla_fused"))
    assert isinstance(info.value, ValueError) and isinstance(info.value, KvplaneError)


# -- decoding what is not a manifest -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "data",
    [b"", b"garbage", b"\xc1", b"\x00", b"\x92\x01\x02", msgspec.msgpack.encode({"engine_id": "x"})],
    ids=["empty", "text", "bad-opcode", "an-int", "an-array", "a-partial-map"],
)
def test_bytes_that_are_not_a_manifest_raise_manifest_decode_error(data: bytes) -> None:
    with pytest.raises(ManifestDecodeError, match="do not hold a kvplane manifest"):
        Manifest.decode(data)


def test_a_truncated_manifest_raises_manifest_decode_error() -> None:
    data = manifest(gqa(), "packed_kv").encode()
    with pytest.raises(ManifestDecodeError, match="truncated"):
        Manifest.decode(data[: len(data) // 2])


def test_a_string_field_holding_invalid_utf8_raises_manifest_decode_error() -> None:
    # a peer's corrupted or hostile handshake: {"engine_id": b"\x80"} as a msgpack str
    with pytest.raises(ManifestDecodeError):
        Manifest.decode(b"\x81\xa9engine_id\xa1\x80")


def test_a_pickle_is_not_a_manifest() -> None:
    with pytest.raises(ManifestDecodeError):
        Manifest.decode(pickle.dumps({"engine_id": "x"}))


def test_a_manifest_whose_spec_is_invalid_raises_manifest_decode_error_naming_the_problem() -> None:
    plain = msgspec.msgpack.decode(manifest(gqa(), "packed_kv").encode())
    plain["spec"]["layers"][0]["slots"][0]["name"] = "q"
    with pytest.raises(ManifestDecodeError, match=r"slot name='q' is unknown"):
        Manifest.decode(msgspec.msgpack.encode(plain))


def test_a_manifest_with_a_field_of_the_wrong_type_raises_manifest_decode_error() -> None:
    plain = msgspec.msgpack.decode(manifest(gqa(), "packed_kv").encode())
    plain["rank"] = "zero"
    with pytest.raises(ManifestDecodeError, match=r"rank"):
        Manifest.decode(msgspec.msgpack.encode(plain))


def test_an_oversized_blob_is_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    data = manifest(gqa(), "packed_kv").encode()
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", len(data) - 1)
    with pytest.raises(ManifestDecodeError, match=rf"manifest of {len(data)} bytes exceeds {len(data) - 1}"):
        Manifest.decode(data)


@settings(max_examples=200, deadline=None, database=None)
@given(st.binary(max_size=256))
def test_any_bytes_decode_to_a_manifest_or_raise_manifest_decode_error(data: bytes) -> None:
    try:
        Manifest.decode(data)
    except ManifestDecodeError:
        pass


_VALID = manifest(gqa(), "packed_kv").encode()


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(st.integers(0, len(_VALID) - 1), st.integers(0, 255))
def test_a_manifest_with_one_corrupted_byte_decodes_or_raises_manifest_decode_error(
    pos: int, value: int
) -> None:
    data = bytearray(_VALID)
    data[pos] = value
    try:
        Manifest.decode(bytes(data))
    except ManifestDecodeError:
        pass
