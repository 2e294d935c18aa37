"""The disaggregation flow: a prefill rank and a decode rank joined by a ZMQ side channel, bytes through a
transport (Mooncake TE or NIXL), in pull, push or layer-wise push mode.

``PrefillSide`` and ``DecodeSide`` are the façades an engine calls (their modules say who calls what);
``TransferParams`` is what travels from prefill to decode through the proxy; ``Completion`` is how every
request ends on either side: ``done``, ``failed`` or ``timed_out``.
"""

from kvplane.flows.disagg.decode.decode_side import DecodeSide
from kvplane.flows.disagg.prefill.prefill_side import PrefillSide
from kvplane.flows.disagg.wire.config import DisaggConfig
from kvplane.flows.disagg.wire.errors import (
    DisaggConfigError,
    DisaggError,
    HandshakeError,
    ProtocolError,
    TransferParamsError,
)
from kvplane.flows.disagg.wire.params import TransferParams
from kvplane.flows.disagg.wire.results import Completion

__all__ = [
    "Completion",
    "DecodeSide",
    "DisaggConfig",
    "DisaggConfigError",
    "DisaggError",
    "HandshakeError",
    "PrefillSide",
    "ProtocolError",
    "TransferParams",
    "TransferParamsError",
]
