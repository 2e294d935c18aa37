"""``python -m kvplane.bench`` is ``kvplane bench``: the same options and the same catalog."""

from __future__ import annotations

import subprocess
import sys

from kvplane.bench import scenarios


def test_python_m_kvplane_bench_lists_the_same_scenarios_as_kvplane_bench() -> None:
    out = subprocess.run([sys.executable, "-m", "kvplane.bench", "--list"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    listed = [line.split() for line in out.splitlines() if line.strip()]
    assert sorted(row[0] for row in listed) == sorted(s.name for s in scenarios.full())
    assert sorted(row[0] for row in listed if row[-1] == "default") == sorted(s.name for s in scenarios.default())
