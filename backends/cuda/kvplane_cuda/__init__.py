"""kvplane-cuda: the kvplane backend for NVIDIA GPUs.

kvplane finds it through the entry point ``cuda`` in the group ``kvplane.backends`` (``KVPLANE_DEVICE=cuda``)
and imports ``kvplane_cuda.plugin`` only when the backend is selected or listed.
"""
