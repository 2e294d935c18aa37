"""``DecodeKit``: what starting a decode request's transfer, staging it and re-laying it out use of the decode
side, handed to ``decode_start.Starter`` and ``staged_pull.StagedPull`` explicitly instead of the side itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvplane.errors import KvplaneError
from kvplane.flows.disagg.decode.records import Want
from kvplane.flows.disagg.wire.channel import Counters
from kvplane.flows.disagg.wire.local import LocalKV
from kvplane.flows.disagg.wire.mover import Mover


@dataclass(frozen=True)
class DecodeKit:
    local: LocalKV  # this rank's KV: spec, caches, layouts, manifest, staging and its arena, the transport
    counters: Counters  # of the side channel
    mover: Mover  # the transfer thread READs go to
    moved: Callable[[Want, int, KvplaneError | None], None]  # a READ from a prefill rank ended (on the loop)
    submit: Callable[[Callable[[], Any]], Any]  # run on the side's I/O loop
