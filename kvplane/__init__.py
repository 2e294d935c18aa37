"""kvplane: moves the paged KV cache of LLM inference engines between device, host, instances and a store.

The core knows no device; accelerators plug in as backends (see ``kvplane.backend``). Layers, top to bottom:
integrations -> flows -> plan -> transports -> kv (spec, layouts, regions, manifest) -> blocks -> backend.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvplane")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"

__all__ = ["__version__"]
