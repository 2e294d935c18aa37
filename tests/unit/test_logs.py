"""Log levels of kvplane's loggers inside and outside vLLM, and the transfer engines' own logs (quiet by default)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvplane.logs import (
    configure_logging,
    engine_logs_enabled,
    kvplane_level,
    quiet_engine_logs,
)


def test_inside_vllm_kvplane_follows_vllm_logging_level_unless_kvplane_log_level_is_set() -> None:
    assert kvplane_level(True, {}) == logging.INFO  # vLLM's own default
    assert kvplane_level(True, {"VLLM_LOGGING_LEVEL": "debug"}) == logging.DEBUG
    assert kvplane_level(True, {"VLLM_LOGGING_LEVEL": "DEBUG", "KVPLANE_LOG_LEVEL": "WARNING"}) == logging.WARNING


def test_outside_vllm_only_kvplane_log_level_counts() -> None:
    assert kvplane_level(False, {"VLLM_LOGGING_LEVEL": "DEBUG"}) is None
    assert kvplane_level(False, {"KVPLANE_LOG_LEVEL": "error"}) == logging.ERROR


def test_a_bad_level_names_the_variable_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"KVPLANE_LOG_LEVEL='loud' is not a log level; use one of DEBUG"):
        kvplane_level(False, {"KVPLANE_LOG_LEVEL": "loud"})


@pytest.fixture
def clean_kvplane_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("kvplane")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    logger.handlers.clear()
    yield logger
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate = saved[2]


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_inside_vllm_kvplane_writes_each_line_once_through_vllms_handlers_or_the_applications(
    clean_kvplane_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch,
) -> None:
    vllm, app = Collect(), Collect()
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [vllm])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # vllm serve: vLLM leaves the root logger alone
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    monkeypatch.delenv("KVPLANE_LOG_LEVEL", raising=False)
    configure_logging(inside_vllm=True)
    configure_logging(inside_vllm=True)  # a second connector in the process adds nothing
    log = logging.getLogger("kvplane.disagg")
    log.debug("served")
    assert clean_kvplane_logger.level == logging.DEBUG and vllm.lines == ["served"]
    logging.getLogger().addHandler(app)  # an application embedding vLLM configured logging (basicConfig)
    log.info("embedded")
    assert vllm.lines == ["served"] and app.lines == ["embedded"]  # once, not through both


def test_kvplane_log_level_debug_inside_vllm_writes_debug_lines_through_vllms_info_handler(
    clean_kvplane_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch,
) -> None:
    vllm = Collect()
    vllm.setLevel(logging.INFO)  # vLLM's handler carries VLLM_LOGGING_LEVEL
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [vllm])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    monkeypatch.setenv("KVPLANE_LOG_LEVEL", "DEBUG")
    configure_logging(inside_vllm=True)
    logging.getLogger("kvplane.disagg").debug("detail")
    assert vllm.lines == ["detail"]  # KVPLANE_LOG_LEVEL overrides VLLM_LOGGING_LEVEL for kvplane alone


def test_with_vllm_configure_logging_0_and_no_root_handler_kvplane_lines_still_reach_stderr(
    clean_kvplane_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [])  # VLLM_CONFIGURE_LOGGING=0
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.delenv("KVPLANE_LOG_LEVEL", raising=False)
    configure_logging(inside_vllm=True)
    [ours] = clean_kvplane_logger.handlers
    seen = Collect()
    monkeypatch.setattr(ours, "stderr", seen)
    logging.getLogger("kvplane.disagg").warning("peer gone")
    assert seen.lines == ["peer gone"]  # our handler hides Python's last-resort one: it must write itself


def test_the_stderr_handler_import_added_gives_way_to_vllms_inside_vllm(clean_kvplane_logger: logging.Logger,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLANE_LOG_LEVEL", "DEBUG")
    configure_logging()  # what ``import kvplane`` does
    vllm = Collect()
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [vllm])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    configure_logging(inside_vllm=True)  # the connector
    logging.getLogger("kvplane.disagg").info("line")
    assert vllm.lines == ["line"] and len(clean_kvplane_logger.handlers) == 1


def test_engine_logs_are_quieted_by_default_without_overriding_what_the_user_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVPLANE_ENGINE_LOGS", raising=False)
    monkeypatch.delenv("MC_LOG_LEVEL", raising=False)
    monkeypatch.setenv("NIXL_LOG_LEVEL", "DEBUG")
    quiet_engine_logs()
    assert os.environ["MC_LOG_LEVEL"] == "ERROR" and os.environ["NIXL_LOG_LEVEL"] == "DEBUG"
    assert engine_logs_enabled({"KVPLANE_ENGINE_LOGS": "1"}) and not engine_logs_enabled({})


ENGINE = """
from kvplane.backend import get_backend
from kvplane.transports.registry import get_transport_class
get_transport_class({name!r})(get_backend("cpu")).close()
"""
# what each engine prints at INFO when a transport starts: glog's "I<date>" lines (stderr), NIXL's (stdout)
INFO_LINE = {"mooncake": lambda line: line.startswith("I"), "nixl": lambda line: " NIXL INFO " in line}
MODULE = {"mooncake": "mooncake.engine", "nixl": "nixl_cu12"}


@pytest.mark.parametrize("switch", ["", "1"], ids=["default", "KVPLANE_ENGINE_LOGS=1"])
@pytest.mark.parametrize("name", ["mooncake", "nixl"])
def test_an_engines_info_lines_appear_only_with_kvplane_engine_logs(name: str, switch: str) -> None:
    pytest.importorskip(MODULE[name], reason=f"needs the {name} engine (the engines extra)")
    env = {k: v for k, v in os.environ.items() if k not in ("MC_LOG_LEVEL", "NIXL_LOG_LEVEL", "KVPLANE_ENGINE_LOGS")}
    if switch:
        env["KVPLANE_ENGINE_LOGS"] = switch
    run = subprocess.run([sys.executable, "-c", ENGINE.format(name=name)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    output = run.stdout.splitlines() + run.stderr.splitlines()
    assert any(INFO_LINE[name](line) for line in output) == bool(switch), output


EMBED = """
import logging, sys
root = logging.getLogger()
before = (root.level, list(root.handlers))
import kvplane.flows.disagg
assert (root.level, list(root.handlers)) == before, "importing kvplane changed the root logger"
logging.getLogger("kvplane.disagg").debug("early line")
if sys.argv[1] == "app":  # the application configures logging after importing kvplane
    logging.basicConfig(format="APP %(message)s")
    logging.getLogger("kvplane.disagg").debug("late line")
"""


@pytest.mark.parametrize("app", ["none", "app"], ids=["no-app-logging", "app-configures-root-later"])
def test_outside_vllm_kvplane_log_level_takes_effect_on_import_and_each_line_is_written_once(app: str) -> None:
    env = {**os.environ, "KVPLANE_LOG_LEVEL": "DEBUG"}
    env.pop("VLLM_LOGGING_LEVEL", None)
    run = subprocess.run([sys.executable, "-c", EMBED, app], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    assert sum("early line" in line for line in lines) == 1, lines
    if app == "app":
        assert [line for line in lines if "late line" in line] == ["APP late line"]  # the app's handler, once
