"""Engine integrations: thin adapters from an engine's connector API to kvplane's flows (``vllm``)."""
