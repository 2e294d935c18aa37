"""The offload flow: a layer-wise asynchronous host tier with a prefix cache, and Mooncake Store behind it.

``OffloadEngine`` is the façade an engine calls (see ``engine.py`` for who calls what); ``start_master``
starts a loopback ``mooncake_master`` for tests and the bench.
"""

from kvplane.flows.offload.config import OffloadConfig, StoreConfig
from kvplane.flows.offload.engine import OffloadEngine
from kvplane.flows.offload.errors import (
    MasterError,
    OffloadConfigError,
    OffloadError,
    StoreError,
    StoreUnavailable,
)
from kvplane.flows.offload.master import MooncakeMaster, start_master

__all__ = [
    "MasterError",
    "MooncakeMaster",
    "OffloadConfig",
    "OffloadConfigError",
    "OffloadEngine",
    "OffloadError",
    "StoreConfig",
    "StoreError",
    "StoreUnavailable",
    "start_master",
]
