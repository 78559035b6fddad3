"""What a process listens on, for the tests that check rank sockets stay on loopback."""

from __future__ import annotations

import ipaddress


def listening(pid: int) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket process ``pid`` listens on."""
    import psutil  # Ray's copy (ray/thirdparty_files), importable once ray is

    proc = psutil.Process(pid)
    conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections(kind="tcp")
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]


def on_loopback(ip: str) -> bool:
    """127.0.0.1 or ::1, also as an IPv4-mapped IPv6 address (``::ffff:127.0.0.1``: gloo's socket)."""
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address) in ("127.0.0.1", "::1")
