"""Facts about host addresses that several layers need (transports, the P/D side channel). Imports nothing of kvplane."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """``localhost`` or an address in 127.0.0.0/8 or ::1; a name other than ``localhost`` is not assumed local."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
