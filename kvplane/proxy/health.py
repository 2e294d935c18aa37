"""Health checks: ``GET /health`` on every instance each ``health_interval_s``, each bounded by
``health_timeout_s``. ``health_failures`` failed checks in a row take an instance out of rotation, the next success
puts it back (``pool.after_check``). A request that cannot connect to an instance takes it out at once.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvplane.proxy.config import Instance
from kvplane.proxy.metrics import ProxyMetrics
from kvplane.proxy.pool import InstancePool

logger = logging.getLogger("kvplane.proxy")


def record(pool: InstancePool, metrics: ProxyMetrics, inst: Instance, why: str) -> None:
    """One health check's result: ``why`` is "" when it passed."""
    if pool.checked(inst, not why):
        if why:
            logger.warning("kvplane proxy: %s %s is out of rotation after %d failed health checks in a row: %s",
                           inst.role, inst.name, pool.failures[inst.name], why)
        else:
            logger.info("kvplane proxy: %s %s is back up", inst.role, inst.name)
    elif why and pool.up[inst.name]:
        logger.info("kvplane proxy: %s %s failed a health check (%d in a row; %d take it out of rotation): %s",
                    inst.role, inst.name, pool.failures[inst.name], pool.health_failures, why)
    metrics.instance_up.labels(inst.role, inst.name).set(1 if pool.up[inst.name] else 0)


def record_unreachable(pool: InstancePool, metrics: ProxyMetrics, inst: Instance, why: str) -> None:
    """A request could not connect to the instance: out of rotation at once, until a health check passes."""
    if pool.failed(inst, out=True):
        logger.warning("kvplane proxy: %s %s is out of rotation: %s", inst.role, inst.name, why)
    metrics.instance_up.labels(inst.role, inst.name).set(0)


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
    interval after startup, so engines still loading get that long. Every instance of every pool is checked at
    once, and the next round starts one interval after the slowest check of this one."""
    while True:
        await asyncio.sleep(interval_s)
        checked = [(pool, inst) for pool in pools for inst in pool.instances]
        results = await asyncio.gather(*(check(session, inst, timeout_s) for _, inst in checked),
                                       return_exceptions=True)
        for (pool, inst), why in zip(checked, results):
            if isinstance(why, Exception):  # a bug of the proxy: the instance keeps its state, checks go on
                logger.error("kvplane proxy: the health check of %s %s failed inside the proxy", inst.role,
                             inst.url, exc_info=why)
            elif isinstance(why, str):
                record(pool, metrics, inst, why)
