"""Joining the cluster at ``$RAY_ADDRESS``: an address where nothing listens is one line at once (``ray.init``
retried for ever there, deaf to Ctrl-C and SIGTERM), and a refused join names a token the machine holds."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from prvrlab.platform import runtime
from prvrlab.platform.runtime import unreachable

REPO = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as sock:  # bound, never listening: a connection is refused
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_address_where_nothing_listens_is_named_and_one_that_answers_is_not():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert unreachable(f"127.0.0.1:{port}") is None
        assert unreachable(f"ray://127.0.0.1:{port}") is None
    closed = _closed_port()
    assert unreachable(f"127.0.0.1:{closed}") == f"nothing answers at 127.0.0.1:{closed}: Connection refused"
    assert unreachable(f"ray://[::1]:{closed}").startswith(f"nothing answers at ::1:{closed}: ")
    assert unreachable("auto") is None and unreachable("local") is None  # Ray resolves these itself


def test_joining_an_address_where_nothing_listens_fails_in_one_line_without_waiting():
    port = _closed_port()
    code = "from prvrlab.platform.runtime import ensure_ray\nensure_ray()\n"
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert time.monotonic() - start < 60
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"prvrlab.platform.config.ConfigError: RAY_ADDRESS=127.0.0.1:{port}: cannot join the Ray cluster "
                    f"(nothing answers at 127.0.0.1:{port}: Connection refused)"), done.stderr[-2000:]


def test_a_refused_join_names_the_token_this_machine_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    assert runtime._token_hint() == ""  # no token: nothing to say
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("secret")
    assert runtime._token_hint() == (f"; {token} exists: a cluster started with token authentication refuses this "
                                     "process unless RAY_AUTH_MODE=token is set, as for the ray commands")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # set: the join failed for another reason
    assert runtime._token_hint() == ""
