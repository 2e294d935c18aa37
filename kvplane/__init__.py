"""kvplane: moves the paged KV cache of LLM inference engines between device, host, instances and a store.

The core knows no device; accelerators plug in as backends (see ``kvplane.backend``). Layers, top to bottom:
integrations -> flows -> plan -> transports -> kv (spec, layouts, regions, manifest) -> blocks -> backend.
"""

import logging
from importlib.metadata import PackageNotFoundError, version

from kvplane.logs import configure_logging

try:
    __version__ = version("kvplane")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"

try:
    configure_logging()  # KVPLANE_LOG_LEVEL, outside vLLM (the vLLM connector applies its own rules)
except ValueError as e:  # a bad level must not make kvplane unimportable (``kvplane info`` included)
    logging.getLogger("kvplane").warning("%s; ignored", e)

__all__ = ["__version__"]
