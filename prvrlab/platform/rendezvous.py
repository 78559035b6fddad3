"""Where DDP ranks on one machine meet without a TCP listener: a node bound to loopback, a FileStore in a
fresh private folder, gloo on the loopback interface (the reused worker pools and Ray Train's worker
groups both use it)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import tempfile

STORE_PREFIX = "prvrlab-pg-"  # a loopback rendezvous's FileStore folder (in the temp folder, 0700)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a node IP) is a loopback address (``localhost`` included)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_interface() -> str | None:
    """The name of the network interface holding 127.0.0.1 (Linux ``lo``, macOS ``lo0``); None if none is found."""
    try:
        import psutil  # Ray's copy (ray/thirdparty_files), importable once ray is

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
                return name
    except Exception:  # noqa: BLE001 - no psutil: the usual names
        pass
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((name for name in ("lo", "lo0") if name in names), None)


def store_folder(init_method: str) -> str | None:
    """The folder of a ``file://`` rendezvous's FileStore; None for another init method."""
    return os.path.dirname(init_method[len("file://"):]) if init_method.startswith("file://") else None


def new_file_store() -> tuple[str, str]:
    """A fresh private (0700) folder and the ``file://`` init method of a FileStore in it (new and empty: a
    FileStore refuses a stale file); :func:`store_folder` gives the folder back from the init method."""
    folder = tempfile.mkdtemp(prefix=STORE_PREFIX)
    return folder, f"file://{folder}/store"


def remove_store(folder: str | None) -> None:
    """Remove a rendezvous folder made by :func:`new_file_store` (None: nothing to do)."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
