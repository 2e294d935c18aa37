"""Log levels and handlers of ``kvplane.*`` loggers, and the transfer engines' own logs.

``configure_logging`` (the vLLM connector calls it with ``inside_vllm=True``, other engines may call it):

- Inside vLLM, ``kvplane`` loggers take ``VLLM_LOGGING_LEVEL`` (default INFO) and write through vLLM's own
  handlers (its format and destination, ``VLLM_LOGGING_CONFIG_PATH`` included); with ``VLLM_CONFIGURE_LOGGING=0``
  vLLM installs none and kvplane writes to stderr while nothing else handles its lines. Records still propagate
  to the root logger: where an application (or pytest) gave it handlers, lines are written there instead, so
  never twice.
- Elsewhere they take ``KVPLANE_LOG_LEVEL`` when it is set (``import kvplane`` applies it) and get a stderr
  handler that writes only while the root logger has none, so an application that configures logging, before or
  after importing kvplane, sees each line once through its own handlers; unset, kvplane leaves logging to the
  application, as a library should. The root logger is never touched.
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


class KvplaneHandler(logging.Handler):
    """The one handler kvplane adds (to the ``kvplane`` logger): it writes through vLLM's handlers (inside vLLM) or
    its own stderr handler, and only while the root logger has none. When an application configured the root
    logger, before or after kvplane, the record reaches it by propagation instead: each line is written once."""

    def __init__(self) -> None:
        super().__init__()
        self.inside_vllm = False
        self.stderr = logging.StreamHandler()
        self.stderr.setFormatter(logging.Formatter(FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        # vLLM's, read now (VLLM_CONFIGURE_LOGGING=0 leaves none: then stderr, or nothing would show at all)
        targets = (logging.getLogger("vllm").handlers if self.inside_vllm else []) or [self.stderr]
        for target in targets:  # the kvplane logger's level already decided, not the handler's:
            target.handle(record)  # KVPLANE_LOG_LEVEL=DEBUG inside vLLM shows DEBUG lines


def configure_logging(inside_vllm: bool = False) -> None:
    """Apply the rules above to the ``kvplane`` logger (idempotent; never touches the root logger)."""
    logger = logging.getLogger(LOGGER)
    level = kvplane_level(inside_vllm)
    if level is None:
        return
    logger.setLevel(level)
    ours = next((h for h in logger.handlers if isinstance(h, KvplaneHandler)), None)
    if ours is None:
        if logger.handlers and not inside_vllm:  # the application gave kvplane's logger handlers of its own
            return
        ours = KvplaneHandler()
        logger.addHandler(ours)
    ours.inside_vllm = ours.inside_vllm or inside_vllm


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
