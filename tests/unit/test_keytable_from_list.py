"""``keytable.from_list`` (kvplane/_native/keytable.c) reads a Python list whose items may run Python code.

An item that is not an ``int`` is converted through its ``__index__``, which can shrink the list being read;
the C loop must not read past the list's current end (it held the length from before the loop, and a list
cleared this way has no item array left: the next read was a NULL dereference, a segfault). Run in a child
process so a crash fails the test instead of ending the run.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvplane.flows.offload import keyed_pool

CHILD = """
import numpy as np
from kvplane._native import _keytable as kt
items = []
class Shrinks:
    def __index__(self):
        items.clear()
        return 1
items.extend([Shrinks(), 2, 3, 4])
out = np.empty(4, dtype=np.int64)
try:
    kt.from_list(items, out)
except (ValueError, RuntimeError, IndexError) as e:
    print("refused:", e)
"""


@pytest.mark.skipif(keyed_pool._native is None, reason="the keytable extension is not built")
def test_a_list_shrunk_by_an_items_index_is_not_read_past_its_end() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"from_list crashed (exit {done.returncode}): {done.stderr[-2000:]}"
    assert "refused:" in done.stdout, f"from_list accepted a list that changed under it: {done.stdout!r}"


@pytest.mark.skipif(keyed_pool._native is None, reason="the keytable extension is not built")
def test_every_int64_comes_back_exactly_and_one_past_either_end_is_refused() -> None:
    from kvplane._native import _keytable as kt  # only where the extension is built

    values = [0, 1, -1, (1 << 30) - 1, 1 << 30, -(1 << 30), (1 << 60) + 12345, -(1 << 62) - 7,
              (1 << 63) - 1, -(1 << 63), True]
    out = np.empty(len(values), dtype=np.int64)
    kt.from_list(values, out)
    assert out.tolist() == [int(v) for v in values]
    for bad in (1 << 63, -(1 << 63) - 1, 1 << 64):
        with pytest.raises(OverflowError):
            kt.from_list([1, bad], np.empty(2, dtype=np.int64))
