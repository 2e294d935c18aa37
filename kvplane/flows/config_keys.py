"""Flow configs built from plain data (a connector's JSON): every key must name a field of the config class.

The check lives in ``kvplane.config`` with the rest of building configs from plain data; this name stays for the
flows that import it.
"""

from kvplane.config import check_keys

__all__ = ["check_keys"]
