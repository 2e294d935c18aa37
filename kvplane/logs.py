"""Log levels and handlers of ``kvplane.*`` loggers, and the transfer engines' own logs.

``configure_logging`` (the vLLM connector calls it with ``inside_vllm=True``, other engines may call it):

- Inside vLLM, ``kvplane`` loggers take ``VLLM_LOGGING_LEVEL`` (default INFO) and write through vLLM's own
  handlers (its format and destination, ``VLLM_LOGGING_CONFIG_PATH`` included); with ``VLLM_CONFIGURE_LOGGING=0``
  vLLM installs none and neither does kvplane. Records still propagate to the root logger (vLLM leaves it
  without handlers), so an application's or pytest's root handlers see them too.
- Elsewhere they take ``KVPLANE_LOG_LEVEL`` when it is set (and get a stderr handler if nothing else handles
  them); unset, kvplane leaves logging to the application, as a library should.
- ``KVPLANE_LOG_LEVEL`` set inside vLLM overrides ``VLLM_LOGGING_LEVEL`` for kvplane alone.

``quiet_engine_logs`` runs before kvplane imports a transfer engine (Mooncake TE, its Store, NIXL): Mooncake's
glog INFO/WARNING lines and NIXL's INFO lines are off unless ``KVPLANE_ENGINE_LOGS=1``. It only sets defaults
(``MC_LOG_LEVEL=ERROR``, ``NIXL_LOG_LEVEL=WARN``): a value the user exported wins. Mooncake reads its variable
when its library loads, so the switch acts on engines imported after it; the bench additionally sends all engine
output to its log file (``kvplane.bench.logs``).
"""

from __future__ import annotations

import logging
import os

LEVEL_ENV = "KVPLANE_LOG_LEVEL"
VLLM_LEVEL_ENV = "VLLM_LOGGING_LEVEL"
ENGINE_LOGS_ENV = "KVPLANE_ENGINE_LOGS"
QUIET_ENGINE_ENV = {"MC_LOG_LEVEL": "ERROR", "NIXL_LOG_LEVEL": "WARN"}
LOGGER = "kvplane"
FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def _level(value: str, variable: str) -> int:
    level = logging.getLevelName(value.strip().upper())
    if not isinstance(level, int):
        raise ValueError(
            f"{variable}={value!r} is not a log level; use one of DEBUG, INFO, WARNING, ERROR, CRITICAL"
        )
    return level


def kvplane_level(inside_vllm: bool, env: dict[str, str] | None = None) -> int | None:
    """The level ``kvplane`` loggers get, or None to leave it alone (outside vLLM with nothing set)."""
    env = dict(os.environ) if env is None else env
    if env.get(LEVEL_ENV):
        return _level(env[LEVEL_ENV], LEVEL_ENV)
    if inside_vllm:
        return _level(env.get(VLLM_LEVEL_ENV) or "INFO", VLLM_LEVEL_ENV)
    return None


def configure_logging(inside_vllm: bool = False) -> None:
    """Apply the rules above to the ``kvplane`` logger (idempotent)."""
    logger = logging.getLogger(LOGGER)
    level = kvplane_level(inside_vllm)
    if level is None:
        return
    logger.setLevel(level)
    if logger.handlers:
        return
    if inside_vllm:
        handlers = logging.getLogger("vllm").handlers
        for handler in handlers:  # vLLM configured its logging: write where and how it does
            logger.addHandler(handler)
    elif not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)


def engine_logs_enabled(env: dict[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get(ENGINE_LOGS_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def quiet_engine_logs() -> None:
    """Default the engines' own log levels to quiet unless ``KVPLANE_ENGINE_LOGS=1`` (see above)."""
    if engine_logs_enabled():
        return
    for variable, value in QUIET_ENGINE_ENV.items():
        os.environ.setdefault(variable, value)
    if os.environ.get("NIXL_LOG_LEVEL") == QUIET_ENGINE_ENV["NIXL_LOG_LEVEL"]:
        logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL already imported: its logger is configured
