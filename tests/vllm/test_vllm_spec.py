"""vLLM's ``KVCacheConfig`` read as a kvplane ``KVSpec``: groups and block sizes kept, MLA split into its slots,
state that is not attention KV refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vLLM: pip install --no-deps vllm==0.27.1 + .[vllm]")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvplane.integrations.vllm.config import ConnectorConfigError  # noqa: E402
from kvplane.integrations.vllm.spec import spec_from_vllm  # noqa: E402


def config(*groups: tuple[list[str], object]) -> KVCacheConfig:
    return KVCacheConfig(64, [], [KVCacheGroupSpec(names, spec) for names, spec in groups])


def test_a_hybrid_config_keeps_vllm_group_indices_block_sizes_and_layer_order() -> None:
    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, sliding_window=128)
    spec = spec_from_vllm(config((["l.0", "l.2"], full), (["l.1"], window)), ["l.0", "l.1", "l.2"])
    assert [(g.group_id, g.tokens_per_block) for g in spec.groups] == [(0, 16), (1, 32)]
    assert [(la.name, la.group_id) for la in spec.layers] == [("l.0", 0), ("l.1", 1), ("l.2", 0)]
    assert spec.layers[0].bytes_per_token == 2 * 8 * 128 * 2


def test_mla_becomes_kv_c_and_k_pe_with_the_models_kv_lora_rank() -> None:
    mla = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    layer = spec_from_vllm(config((["m.0"], mla)), ["m.0"]).layers[0]
    assert [(s.name, s.head_dim) for s in layer.slots] == [("kv_c", 512), ("k_pe", 64)]
    other = spec_from_vllm(config((["m.0"], mla)), ["m.0"], kv_lora_rank=448).layers[0]
    assert [s.head_dim for s in other.slots] == [448, 128]


def test_mamba_state_and_unknown_layers_are_refused_naming_what_to_do() -> None:
    mamba = MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,))
    with pytest.raises(ConnectorConfigError, match="MambaSpec holds no attention KV"):
        spec_from_vllm(config((["s.0"], mamba)), ["s.0"])
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    with pytest.raises(ConnectorConfigError, match=r"layers \['x'\] that no KV-cache group names"):
        spec_from_vllm(config((["a"], full)), ["a", "x"])
