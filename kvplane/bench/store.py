"""Store-tier scenarios (kind ``store``): host blocks into and out of Mooncake Store through kvplane's store
tier, against raw ``MooncakeDistributedStore.batch_put_from`` / ``batch_get_into`` of the same bytes.

A model's put and get rows share a loopback ``mooncake_master`` and an ``OffloadEngine`` whose store tier
writes through (started by the first of them, stopped after get or before another module's row). A request's
blocks (2k tokens of 16-token blocks by default, 512 with ``--quick``; the ``-10k`` variants are not in the
default set) are stored once; their host blocks are the source of every put.

- ``put``: the tier's write of those host blocks under a fresh prefix (keys, addresses, the put on the tier's
  worker, its future, the pins it holds until ``poll`` releases them) vs ``batch_put_from`` of the same host
  blocks under fresh keys, on the same client. ``params["engine_gbps"]``: a whole write-through store of a
  fresh prefix from the device (start_store .. wait_for_save, D2H included) until its put is done.
- ``get``: the tier's fetch of a prefix only the store holds into free host blocks (existence is checked by
  the engine's lookup first, as a load does) vs ``batch_get_into`` of the same objects into the same host
  blocks. ``params["engine_gbps"]``: a whole ``start_load`` of such a prefix onto the device (H2D included).

Bytes are verified: a put is read back with a raw get and compared with its host blocks; a whole load from
the store is compared with the device blocks it came from. Objects are removed after each rep so the
store's segment holds at most a few copies.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

from kvplane.backend.base import Backend
from kvplane.bench.held import Held
from kvplane.bench.local_copy import same_blocks
from kvplane.bench.models import model_spec
from kvplane.bench.offload import BLOCK_TOKENS, OffloadRig, build_rig, load_once, store_once
from kvplane.bench.results import BenchResult, make_result
from kvplane.bench.scenario import Scenario
from kvplane.bench.timing import MIN_REPS, Samples, timed, timed_cpu
from kvplane.flows.offload import StoreConfig, start_master
from kvplane.flows.offload.spill import StoreLink
from kvplane.kv.binding import LayoutChoice

TOKENS, QUICK_TOKENS, BIG_TOKENS = 2_000, 512, 10_000
GROUP = 0


class _Prefixes:
    """Fresh block hashes, never seen by the host tier or the store (distinct from the rig's own prefixes)."""

    def __init__(self, blocks: int) -> None:
        self._blocks = blocks
        self._next = itertools.count(1)

    def __call__(self) -> list[int]:
        base = next(self._next) << 32
        return list(range(base, base + self._blocks))


class StoreRig:
    """An offload rig with a write-through store tier, its stored source prefix pinned in the host tier."""

    def __init__(
        self, backend: Backend, model: str, tokens: int, master_address: str, layouts: LayoutChoice | None = None
    ) -> None:
        blocks = -(-tokens // BLOCK_TOKENS)
        nbytes = blocks * model_spec(model, BLOCK_TOKENS).bytes_per_token * BLOCK_TOKENS
        config = StoreConfig(
            master_address, write_through=True, segment_bytes=4 * nbytes + (64 << 20),
            local_buffer_bytes=16 << 20, timeout_s=30.0, namespace="kvplane-bench",
        )
        # the host tier holds two requests: the pinned source and one fetched prefix
        self.rig: OffloadRig = build_rig(
            backend, model, tokens, host_blocks_factor=2, store=config, layouts=layouts
        )
        engine = self.rig.engine
        if engine.store is None or not engine.store.tier.up:
            raise RuntimeError(f"bench: the store tier at {master_address} is not up")
        self.link: StoreLink = engine.store
        self.client: Any = self.link.tier.client  # the same MooncakeDistributedStore the tier drives
        self.source = next(self.rig.prefixes)
        store_once(self.rig, "bench-source", self.source)
        engine.wait_idle()
        self.source_ids = engine.index.pin(GROUP, self.source)  # never evicted while the bench runs
        self.addrs, self.sizes = self.link.addrs(GROUP, self.source_ids)
        self.fresh = _Prefixes(len(self.source))
        self.nbytes = int(sum(self.sizes))

    def remove(self, keys: list[str]) -> None:
        self.client.batch_remove(keys, True)  # force: a get leaves a lease on its objects

    def raw_keys(self) -> list[str]:
        return [f"kvplane-bench-raw/{h:016x}" for h in self.fresh()]

    def close(self) -> None:
        self.rig.engine.index.release(GROUP, self.source_ids)
        self.rig.close()


def _tier_put(s: StoreRig) -> tuple[float, float, list[str]]:
    hashes = s.fresh()
    ids = s.rig.engine.index.pin(GROUP, s.source)  # write() takes over this reference until the put is done

    def put() -> None:
        s.link.write(GROUP, ids, hashes)
        s.rig.engine.wait_idle()

    seconds, cpu = timed_cpu(put)
    return seconds, cpu, s.link.keys(GROUP, hashes)


def _raw_put(s: StoreRig) -> tuple[float, list[str], list[int]]:
    keys = s.raw_keys()
    codes: list[int] = []
    seconds = timed(lambda: codes.extend(s.client.batch_put_from(keys, s.addrs, s.sizes)))
    return seconds, keys, codes


def _put_back_equal(s: StoreRig, keys: list[str]) -> bool:
    """Read ``keys`` back with raw gets into free host blocks and compare with the source blocks."""
    engine = s.rig.engine
    scratch = engine.index.allocate(GROUP, len(keys))
    try:
        addrs, sizes = s.link.addrs(GROUP, scratch)
        got = s.client.batch_get_into(keys, addrs, sizes)
        if list(got) != sizes:
            return False
        pool = engine.pool
        for src, dst in ((int(a), int(b)) for a, b in zip(s.source_ids, scratch)):
            if not bool((pool.block(GROUP, src) == pool.block(GROUP, dst)).all()):
                return False
        return True
    finally:
        engine.index.release(GROUP, scratch)


def run_put(s: StoreRig) -> tuple[Samples, bool, dict[str, Any]]:
    samples, e2e = Samples(), []
    verified = True
    for rep in range(MIN_REPS + 1):  # the first round warms up
        t, cpu, keys = _tier_put(s)
        if rep == 0:
            verified = _put_back_equal(s, keys)
        s.remove(keys)
        r, raw_keys, codes = _raw_put(s)
        verified = verified and all(c == 0 for c in codes)
        s.remove(raw_keys)
        hashes = s.fresh()

        def whole_store() -> None:
            store_once(s.rig, f"bench-put-{rep}", hashes)  # noqa: B023
            s.rig.engine.wait_idle()

        e = timed(whole_store)
        s.remove(s.link.keys(GROUP, hashes))
        if rep:
            samples.add(t, cpu, r)
            e2e.append(e)
    return samples, verified, _e2e(s, e2e)


def run_get(s: StoreRig) -> tuple[Samples, bool, dict[str, Any]]:
    engine = s.rig.engine
    samples, e2e = Samples(), []
    verified = True
    for rep in range(MIN_REPS + 1):
        hashes, load_hashes = s.fresh(), s.fresh()
        keys, load_keys = s.link.keys(GROUP, hashes), s.link.keys(GROUP, load_hashes)
        for k in (keys, load_keys):  # untimed: the objects the gets read
            if any(c != 0 for c in s.client.batch_put_from(k, s.addrs, s.sizes)):
                raise RuntimeError("bench: a raw put of the get scenario's source failed")
        fetched: list[Any] = []

        def fetch() -> None:
            if s.link.count_prefix(GROUP, hashes) != len(hashes):  # what a load's lookup asks first
                raise RuntimeError("bench: the store does not hold the prefix just put")
            fetched.append(s.link.fetch(GROUP, hashes))

        t, cpu = timed_cpu(fetch)
        ids = fetched[0]
        verified = verified and len(ids) == len(hashes)
        engine.index.release(GROUP, ids)
        addrs, sizes = s.link.addrs(GROUP, ids)  # the same host blocks, for the raw get
        codes: list[int] = []
        r = timed(lambda: codes.extend(s.client.batch_get_into(keys, addrs, sizes)))  # noqa: B023
        verified = verified and list(codes) == sizes
        tokens: list[int] = []
        e = timed(lambda: tokens.append(load_once(s.rig, f"bench-get-{rep}", load_hashes)))  # noqa: B023
        verified = verified and tokens[0] == len(load_hashes) * BLOCK_TOKENS
        if rep == 0:
            rig = s.rig
            verified = verified and same_blocks(
                rig.spec, rig.cache, rig.src_ids, rig.cache, rig.dst_ids, rig.layouts
            )
        s.remove(keys + load_keys)
        if rep:
            samples.add(t, cpu, r)
            e2e.append(e)
    return samples, verified, _e2e(s, e2e)


def _e2e(s: StoreRig, seconds: list[float]) -> dict[str, Any]:
    med = statistics.median(seconds)
    gbps = round(s.nbytes / med / 1e9, 3) if med > 0 else 0.0
    note = f"whole engine path incl. device copies: {gbps:.1f} GB/s"
    return {"engine_s": round(med, 4), "engine_gbps": gbps, "note": note}


class _Tier:
    """A running ``mooncake_master`` and the store rig on it, shared by a model's put and get rows."""

    def __init__(self, backend: Backend, model: str, tokens: int, layouts: LayoutChoice | None) -> None:
        self.master = start_master()
        try:
            self.rig = StoreRig(backend, model, tokens, self.master.address, layouts)
        except BaseException:
            self.master.stop()
            raise

    def close(self) -> None:
        try:
            self.rig.close()
        finally:
            self.master.stop()


_held: Held[_Tier] = Held(_Tier.close)


def _release() -> None:
    _held.release()


def run_store(
    backend: Backend, model: str, op: str, tokens: int, quick: bool, layouts: LayoutChoice | None = None,
    name: str | None = None,
) -> BenchResult:
    tokens = min(tokens, QUICK_TOKENS) if quick else tokens
    key = (backend.label, id(backend), model, tokens, repr(layouts))
    s = _held.get(key, lambda: _Tier(backend, model, tokens, layouts)).rig
    try:
        samples, verified, extra = run_put(s) if op == "put" else run_get(s)
    except BaseException:
        _release()  # a failed row leaves no half-used store behind for the next one
        raise
    if op == "get":  # get runs after put for each model: the master and buffers go before the next row
        _release()
    return make_result(scenario=name or _name(model, op, tokens if not quick else TOKENS), kind="store",
                       backend=backend.label, transport="mooncake-store", nbytes=s.nbytes, samples=samples,
                       baseline=f"raw batch_{'put_from' if op == 'put' else 'get_into'}", verified=verified,
                       descriptors=len(s.source),
                       params={
                           "model": model, "op": op, "mode": op, "tokens": tokens, "block_tokens": BLOCK_TOKENS,
                           "blocks": len(s.source), "objects_per_call": len(s.source), **extra,
                       })


def _name(model: str, op: str, tokens: int) -> str:
    return f"store-{model}-{op}" + ("" if tokens == TOKENS else f"-{tokens // 1000}k")


def available() -> bool:
    """Mooncake Store is installed; without it there is nothing to measure and the catalog leaves these out."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    return True


def scenario(
    model: str, op: str, tokens: int = TOKENS, layouts: LayoutChoice | None = None, variant: str = ""
) -> Scenario:
    name = _name(model, op, tokens) + variant

    def run(backend: Backend, quick: bool) -> BenchResult:
        return run_store(backend, model, op, tokens, quick, layouts, name)

    return Scenario(name, "store", run, {"model": model, "op": op, "tokens": tokens}, release=_release)
