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


def test_starting_a_local_cluster_is_said_through_echo_and_joining_is_not(monkeypatch, capsys):
    """The seconds a local cluster takes to start are announced through the caller's ``echo`` (none:
    silent); joining ``$RAY_ADDRESS`` keeps its own stderr line and says nothing there."""
    import ray

    from prvrlab.platform import runtime

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("PRVRLAB_RAY_BIND", raising=False)
    said: list[str] = []
    runtime.ensure_ray(num_cpus=3, echo=said.append)
    assert calls[-1]["address"] == "local" and calls[-1]["num_cpus"] == 3
    assert said == ["starting a local Ray cluster (3 CPUs, on 127.0.0.1; RAY_ADDRESS joins a running one)"]
    runtime.ensure_ray(num_cpus=3)
    assert len(calls) == 2 and capsys.readouterr().out == ""  # no echo: silent
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.setattr(runtime, "unreachable", lambda address, **kw: None)  # a cluster answers there
    runtime.ensure_ray(echo=said.append)
    assert calls[-1]["address"] == "127.0.0.1:6379" and len(said) == 1
    assert "joining the Ray cluster at 127.0.0.1:6379" in capsys.readouterr().err
