"""Health checks: ``GET /health`` on every instance each ``health_interval_s``; a failure takes it out of
selection, the next success puts it back. A request that cannot connect to an instance takes it out at once.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvplane.proxy.config import Instance
from kvplane.proxy.metrics import ProxyMetrics
from kvplane.proxy.pool import InstancePool

logger = logging.getLogger("kvplane.proxy")


def record(pool: InstancePool, metrics: ProxyMetrics, inst: Instance, up: bool, why: str = "") -> None:
    if pool.mark(inst, up):
        if up:
            logger.info("kvplane proxy: %s %s is back up", inst.role, inst.url)
        else:
            logger.warning("kvplane proxy: %s %s is out of rotation: %s", inst.role, inst.url, why)
    metrics.instance_up.labels(inst.role, inst.url).set(1 if up else 0)


async def check(session: aiohttp.ClientSession, inst: Instance, timeout_s: float) -> str:
    """"" when the instance answers ``GET /health`` with 200, else why not."""
    try:
        async with session.get(f"{inst.url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            return "" if resp.status == 200 else f"GET /health answered {resp.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f"GET /health failed: {type(e).__name__}: {e}"


async def run_checks(session: aiohttp.ClientSession, pools: list[InstancePool], metrics: ProxyMetrics,
                     interval_s: float, timeout_s: float) -> None:
    """Runs until cancelled (the app's cleanup does it). Instances start in rotation; the first check is one
    interval after startup, so engines still loading get that long."""
    while True:
        await asyncio.sleep(interval_s)
        for pool in pools:
            results = await asyncio.gather(*(check(session, inst, timeout_s) for inst in pool.instances),
                                           return_exceptions=True)
            for inst, why in zip(pool.instances, results):
                if isinstance(why, Exception):  # a bug of the proxy: the instance keeps its state, checks go on
                    logger.error("kvplane proxy: the health check of %s %s failed inside the proxy", inst.role,
                                 inst.url, exc_info=why)
                elif isinstance(why, str):
                    record(pool, metrics, inst, not why, why)
