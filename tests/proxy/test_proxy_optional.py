"""aiohttp and prometheus_client come with the ``proxy`` extra only: without them every other ``kvplane``
subcommand works, and ``kvplane proxy`` says what to install."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # runs the CLI as its own process

# runs the CLI in a process where importing aiohttp and prometheus_client fails, as where they are not installed
WITHOUT = ("import sys; sys.modules['aiohttp'] = None; sys.modules['prometheus_client'] = None; "
           "from kvplane.cli.main import main; sys.exit(main(sys.argv[1:]))")


def cli_without_the_proxy_extra(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT, *argv], capture_output=True, text=True, timeout=120)


def test_kvplane_parses_its_commands_without_the_proxy_extra() -> None:
    """The parser adds the proxy's flags for every subcommand: that must not import aiohttp."""
    done = cli_without_the_proxy_extra("info", "--help")
    assert done.returncode == 0, done.stderr
    assert "--json" in done.stdout


def test_kvplane_proxy_without_the_proxy_extra_names_what_to_install() -> None:
    done = cli_without_the_proxy_extra("proxy", "--prefill", "http://127.0.0.1:8100", "--decode",
                                       "http://127.0.0.1:8200")
    assert done.returncode == 2, done.stderr
    assert 'pip install "kvplane[proxy]"' in done.stderr, done.stderr
