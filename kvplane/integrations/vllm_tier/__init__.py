"""kvplane's Mooncake Store tier as a secondary tier of vLLM's own OffloadingConnector (``TieringOffloadingSpec``).

vLLM keeps its CPU offload (the primary tier); this tier moves whole primary slots to and from Mooncake Store,
straight from the primary tier's shared memory, which it registers with Mooncake (no extra copy). Configure it as
vLLM documents secondary tiers::

    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": ...,
        "secondary_tiers": [{"type": "KVPlaneStoreTier", "module_path": "kvplane.integrations.vllm_tier",
                             "store": {"master_address": "10.0.0.1:50051"}}]}

vLLM 0.33 loads an out-of-tree tier by ``module_path``; 0.27.1 only by a registered type, which kvplane's
``vllm.general_plugins`` entry point registers (``kvplane.integrations.vllm.plugin``). docs/engines.md has the
details and what is tested.
"""

from kvplane.integrations.vllm_tier.tier import KVPlaneStoreTier

__all__ = ["KVPlaneStoreTier"]
