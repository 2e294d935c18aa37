"""Figures for docs/disagg.md, not a test: P/D time across two namespaces against loopback, and the times of a
link that goes down mid-transfer. Run as root from the repository root:

    PYTHONPATH=.:tests/unit:tests/disagg:tests/netns python tests/netns/measure_pd.py pd [--tokens 10000]
    PYTHONPATH=.:tests/unit:tests/disagg:tests/netns python tests/netns/measure_pd.py linkdown
    PYTHONPATH=.:tests/unit:tests/disagg:tests/netns python tests/netns/measure_pd.py first [--tokens 3000]

``pd``: a Qwen3-0.6B-shaped cache (28 layers, 8 KV heads of 128, bf16: 114,688 B a token), pull and push, Mooncake
and NIXL; loopback runs both workers in one namespace on 127.0.0.1 (NIXL with UCX's default, cma, and with
``UCX_TLS=tcp``), the veth runs them in two (NIXL on TCP over the veth), then under a 1 Gbit tbf cap.
``linkdown``: the 64 MiB request of ``test_link_down.py`` under a 200 Mbit cap, the link cut 0.4 s in; link down
to verdict, verdict to fence (the request reported), link up to the next request done.
``first``: a pair's first request across the veth with no warm-up (handshake, transport connection and the
engines' first transfer inside it), then a second one, per engine and mode (issue 28 finding 6).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from netpair import Pair
from nslink import Link, Side

from kvplane.kv.spec import KVSpec

QWEN3_06B = KVSpec.gqa(28, 8, 128, tokens_per_block=16)


class Loopback:
    """Both workers in namespace ``a``, on 127.0.0.1."""

    def __init__(self, link: Link) -> None:
        self.index = link.index
        self.a = Side(link.a.netns, "lo", "127.0.0.1")
        self.b = Side(link.a.netns, "lo", "127.0.0.1")


def one(link: Any, engine: str, mode: str, tokens: int, env: dict[str, str] | None, tmp: Path) -> float:
    blocks = -(-tokens // 16)
    pair = Pair(link, tmp, engine, mode, QWEN3_06B, blocks + 8, decode_env=env, prefill_env=env,
                transfer_timeout_s=300.0, push_timeout_s=400.0, lease_s=600.0, heartbeat_s=1.0)
    try:
        ids = list(range(blocks))
        pair.start("warm", ids[:8], ids[:8], 128)  # handshakes and connections, outside the timing
        assert pair.wait("warm", 120)["state"] == "done"
        start = time.monotonic()
        pair.start("big", ids, ids, tokens)
        done = pair.wait("big", 600)
        assert done["state"] == "done", done
        assert pair.same_bytes(ids, ids, tokens)
        return float(done["at"]) - start
    finally:
        pair.close()


def pd(tokens: int) -> None:
    with Link() as link, tempfile.TemporaryDirectory() as tmp:
        cases: list[tuple[str, Any, dict[str, str] | None]] = [
            ("loopback", Loopback(link), {"UCX_TLS": "", "UCX_NET_DEVICES": ""}),
            ("loopback, UCX on tcp", Loopback(link), {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}),
            ("two namespaces (veth)", link, None),
        ]
        for name, where, env in cases:
            for engine in ("mooncake", "nixl"):
                if "UCX" in name and engine == "mooncake":
                    continue
                for mode in ("pull", "push"):
                    s = one(where, engine, mode, tokens, env if engine == "nixl" else None, Path(tmp))
                    print(f"{name:24} {engine:8} {mode}: {s:.2f} s for {tokens} tokens", flush=True)
        link.rate("1gbit")
        for engine in ("mooncake", "nixl"):
            s = one(link, engine, "pull", tokens, None, Path(tmp))
            print(f"{'veth, 1 Gbit tbf cap':24} {engine:8} pull: {s:.2f} s for {tokens} tokens", flush=True)


def first(tokens: int, engines: list[str]) -> None:
    for engine in engines:
        for mode in ("push", "pull"):
            with Link() as link, tempfile.TemporaryDirectory() as tmp:
                blocks = -(-tokens // 16)
                pair = Pair(link, Path(tmp), engine, mode, QWEN3_06B, blocks + 8, transfer_timeout_s=120.0,
                            push_timeout_s=120.0, lease_s=300.0)
                try:
                    ids = list(range(blocks))
                    took = []
                    for rid in ("first", "second"):
                        start = time.monotonic()
                        pair.start(rid, ids, ids, tokens)
                        done = pair.wait(rid, 200)
                        assert done["state"] == "done", done
                        took.append(float(done["at"]) - start)
                    assert pair.same_bytes(ids, ids, tokens)
                    print(f"{engine:8} {mode}: first request {took[0]:.2f} s, second {took[1]:.2f} s for {tokens} "
                          f"tokens", flush=True)
                finally:
                    pair.close()


def linkdown(engines: list[str], keep: Path | None) -> None:
    from test_link_down import BLOCKS, FAST, SPEC, TOKENS, cut_mid_transfer, wait_for

    for engine in engines:
        for mode in ("pull", "push"):
            with Link() as link, tempfile.TemporaryDirectory(prefix=f"kvplane-{engine}-{mode}-") as tmp:
                link.rate("200mbit")
                pair = Pair(link, Path(tmp), engine, mode, SPEC, BLOCKS, **FAST)
                try:
                    t = cut_mid_transfer(pair, link, list(range(1, 129)), list(range(2, 130)))
                    link.up()
                    up = time.monotonic()
                    link.unrate()
                    pair.start("next", list(range(140, 268)), list(range(150, 278)), TOKENS)
                    done = pair.wait("next", 60)
                    assert done["state"] == "done", done
                    wait_for(pair, "decode", "emptying", lambda s: s["pending"] == 0)
                    print(f"{engine:8} {mode}: down->verdict {t['verdict'] - t['down']:.2f} s, verdict->fence "
                          f"{t['fence'] - t['verdict']:.2f} s, down->fence {t['fence'] - t['down']:.2f} s, "
                          f"up->next done {done['at'] - up:.2f} s", flush=True)
                finally:
                    pair.close()
                    if keep:
                        for log in Path(tmp).glob("*.log"):
                            (keep / f"{engine}-{mode}-{log.name}").write_bytes(log.read_bytes())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["pd", "linkdown", "first"])
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--engine", action="append", choices=["mooncake", "nixl"])
    parser.add_argument("--keep-logs", type=Path, help="copy the workers' logs here")
    args = parser.parse_args()
    if args.what == "pd":
        pd(args.tokens or 10_000)
    elif args.what == "first":
        first(args.tokens or 3000, args.engine or ["nixl", "mooncake"])
    else:
        linkdown(args.engine or ["mooncake", "nixl"], args.keep_logs)
