"""Flows: what kvplane does with the layers below it. ``offload`` moves KV between the device, a host tier and a
cluster-wide store; disaggregation (prefill <-> decode) lives beside it."""
