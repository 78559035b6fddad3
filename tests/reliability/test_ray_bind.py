"""A locally started Ray cluster listens on the loopback interface only."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import json
    import ray  # puts Ray's bundled psutil on sys.path
    import psutil
    from prvrlab.platform.runtime import ensure_ray
    ensure_ray(num_cpus=1)
    ray.get(ray.remote(lambda: 1).remote())
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    pids = {p.pid: p.name() for p in procs}
    listening = sorted(
        {
            (pids[c.pid], c.laddr.ip)
            for c in psutil.net_connections(kind="tcp")
            if c.pid in pids and c.status == psutil.CONN_LISTEN
        }
    )
    print("LISTEN " + json.dumps(listening))
    ray.shutdown()
    """
)


def listening(env_extra: dict[str, str]) -> list[tuple[str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PRVRLAB_RAY_BIND")}
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("LISTEN ")]
    assert lines, out.stderr[-3000:]
    return [tuple(x) for x in json.loads(lines[-1][len("LISTEN ") :])]


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or bool(mapped and mapped.is_loopback)


@pytest.mark.slow
def test_local_cluster_listens_on_loopback_only():
    sockets = listening({})
    assert sockets, "no listening sockets found: the probe saw no Ray processes"
    exposed = [s for s in sockets if not is_loopback(s[1])]
    assert not exposed, f"servers listening beyond loopback: {exposed}"


@pytest.mark.slow
def test_bind_opt_out_keeps_rays_default():
    sockets = listening({"PRVRLAB_RAY_BIND": "0.0.0.0"})
    assert any(not is_loopback(ip) for _, ip in sockets), sockets
