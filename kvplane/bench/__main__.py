"""``python -m kvplane.bench [options]``: the same as ``kvplane bench [options]`` (for a checkout without the
console script installed)."""

from __future__ import annotations

import sys

from kvplane.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
