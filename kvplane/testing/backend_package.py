"""What a backend package's own tests check about how kvplane finds it, shared by ``backends/*/tests``.

A backend package declares its entry point in its pyproject, must import its plugin without its device package,
and states registration facts checked against regions of device memory; these helpers do the common part.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from importlib.metadata import EntryPoint, PackageNotFoundError, distribution
from pathlib import Path

from kvplane.backend.registry import GROUP, BackendRegistry
from kvplane.descriptors import Region, SlotPart


def declared_entry_points(pyproject: Path) -> dict[str, str]:
    """The ``kvplane.backends`` entry points ``pyproject`` declares: ``{name: module}``."""
    toml = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")
    with pyproject.open("rb") as f:
        return dict(toml.load(f)["project"]["entry-points"][GROUP])


def registry_of(pyproject: Path) -> BackendRegistry:
    """A registry that sees exactly the backends ``pyproject`` declares, as if only that package were installed."""
    eps = [EntryPoint(name, value, GROUP) for name, value in declared_entry_points(pyproject).items()]
    return BackendRegistry(lambda: eps)


def installed_entry_points(distribution_name: str) -> dict[str, str] | None:
    """The ``kvplane.backends`` entry points of the installed distribution; None when it is not installed."""
    try:
        dist = distribution(distribution_name)
    except PackageNotFoundError:
        return None
    return {ep.name: ep.value for ep in dist.entry_points if ep.group == GROUP}


def plugin_imports(plugin_module: str, device_package: str) -> tuple[list[str], bool]:
    """In a fresh interpreter, import ``plugin_module``, build its backend and ask for registration spans: the
    imports of ``device_package`` that were attempted, and whether it ended up imported."""
    code = textwrap.dedent(
        f"""
        import sys
        attempts = []
        class Recorder:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == {device_package!r}:
                    attempts.append(name)
                return None
        sys.meta_path.insert(0, Recorder())
        import {plugin_module} as plugin
        plugin.kvplane_backend()(0).registration_spans([])
        print(repr(attempts), {device_package!r} in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    attempts, imported = out.rsplit(" ", 1)
    return [a.strip(" '") for a in attempts.strip("[]").split(",") if a.strip()], imported.strip() == "True"


def region(addr: int, nbytes: int, *, layer: int = 0, slot: str = "k", num_blocks: int = 1) -> Region:
    """One region of ``nbytes`` at ``addr`` in ``num_blocks`` contiguous blocks of 16 tokens."""
    block = nbytes // num_blocks
    return Region(group_id=0, layer=layer, layer_name=f"layers.{layer}", addr=addr, num_blocks=num_blocks,
                  block_stride=block, block_bytes=block, tokens_per_block=16, heads=1, row_bytes=block // 16,
                  parts=(SlotPart(slot, 0, block // 16),))
