"""Ray clusters started by tests: `ray start` heads and in-process simulated clusters, on 127.0.0.1 with their own temp dirs.

Only the cluster a test started is stopped (``ray stop`` would stop every Ray
on the machine).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]
NO_DRAIN = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}  # a head stopped by SIGTERM would wait up to 30 s for its node to drain


def ray_bin() -> Path:
    """The folder holding the ``ray`` and ``prvrlab`` scripts of this environment."""
    venv = os.environ.get("VIRTUAL_ENV")
    candidate = Path(venv) / "bin" if venv else REPO / ".venv" / "bin"
    return candidate if (candidate / "ray").exists() else Path(shutil.which("ray")).parent


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def auth_env() -> dict[str, str]:
    """The same RAY_AUTH_MODE for `ray start` and `ray job submit` (REFERENCE §6)."""
    if (Path.home() / ".ray" / "auth_token").exists():
        return {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
    return {}


def wait_for_dashboard(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "ray start exited early"
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                return
        except urllib.error.HTTPError:
            return  # answering (401 with token authentication on)
        except OSError:
            time.sleep(1)
    raise AssertionError("the Ray dashboard did not come up")


@dataclass
class Head:
    url: str  # the dashboard / job submission address
    env: dict[str, str]  # environment for `ray` commands (PATH, auth, no RAY_ADDRESS)
    bin: Path

    def ray(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        """Run ``ray <args>`` against this head (text output captured)."""
        return subprocess.run([str(self.bin / "ray"), *args], env=self.env, capture_output=True, text=True, **kwargs)

    def submit(self, *args: str, attempts: int = 20, **kwargs) -> subprocess.CompletedProcess:
        """``ray job submit <args>``, retried while the head's job agent is still starting (busy machines), and
        when the job server dropped the connection while the working directory was being uploaded (seen once
        in a full suite: no job exists yet then, so a retry cannot submit it twice)."""
        for _ in range(attempts):
            done = self.ray("job", "submit", "--address", self.url, *args, **kwargs)
            said = done.stderr + done.stdout
            dropped = "Connection aborted" in said and "upload_working_dir_if_needed" in said
            if done.returncode == 0 or not ("No available agent" in said or dropped):
                return done
            time.sleep(3)
        return done


# argv: the owner's pid, the head's process group, its temp dir.  Polls the owner; once it is gone,
# stops the head (SIGTERM to it, SIGKILL to its process group within 30 s) and removes the temp dir.
_WATCHDOG = """
import os, shutil, signal, sys, time
owner, group, temp_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
while alive(owner):
    time.sleep(1)
try:
    os.kill(group, signal.SIGTERM)  # the head alone (see stop_head)
    deadline = time.time() + 30
    while time.time() < deadline and alive(group):
        time.sleep(0.5)
    os.killpg(group, signal.SIGKILL)
except ProcessLookupError:
    pass
shutil.rmtree(temp_dir, ignore_errors=True)
"""


def stop_head(head: subprocess.Popen, *, grace_s: float = 30) -> None:
    """Stop a ``ray start --head --block`` process started in its own session: SIGTERM to it alone, so that
    it stops the node's processes itself (a SIGTERM to the whole group killed the GCS first, and a head
    started without :data:`NO_DRAIN` then waited 30 s for it to drain the node), then SIGKILL to whatever
    is left of its process group."""
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.wait()


@contextmanager
def head_node(num_cpus: int = 2) -> Iterator[Head]:
    """A ``ray start --head --block`` child process bound to 127.0.0.1; stopped on exit."""
    bin_dir = ray_bin()
    port, dash, client, agent, agent_grpc, env_agent, metrics, node_mgr, obj_mgr = free_ports(9)
    env = {**os.environ, **auth_env(), **NO_DRAIN, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    temp_dir = Path("/tmp") / f"ray_prvrlab_{os.getpid()}_{port}"
    cmd = [
        str(bin_dir / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1", "--disable-usage-stats", f"--port={port}",
        f"--dashboard-port={dash}", f"--ray-client-server-port={client}", f"--num-cpus={num_cpus}",
        f"--temp-dir={temp_dir}", f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={env_agent}",
        f"--metrics-export-port={metrics}", f"--node-manager-port={node_mgr}", f"--object-manager-port={obj_mgr}",
    ]  # fmt: skip: every port free, so that another cluster on the machine cannot collide
    head = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    watchdog = subprocess.Popen(  # stops the head if this process dies without running the teardown below
        [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(head.pid), str(temp_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"http://127.0.0.1:{dash}"
    try:
        wait_for_dashboard(url, head)
        yield Head(url=url, env=env, bin=bin_dir)
    finally:
        watchdog.kill()
        watchdog.wait()
        stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


@dataclass
class SimulatedCluster:
    """A head and worker nodes in this process's machine (``ray.cluster_utils.Cluster``), on 127.0.0.1."""

    cluster: object  # ray.cluster_utils.Cluster
    temp_dir: Path

    def add_node(self, num_cpus: int):
        """Start a worker node with ``num_cpus`` logical CPUs; returns it (``.node_id``)."""
        return self.cluster.add_node(num_cpus=num_cpus, node_ip_address="127.0.0.1", temp_dir=str(self.temp_dir))

    def remove_node(self, node) -> None:
        """Kill a worker node's processes at once (as a lost machine)."""
        self.cluster.remove_node(node, allow_graceful=False)

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id


def kill_processes_under(folder: Path, timeout_s: float = 10.0) -> None:
    """Kill every process whose command line names ``folder`` (a Ray node's processes name its temp
    folder) and wait until none is left, from /proc (Linux; elsewhere nothing is done)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if str(folder).encode() in cmdline.read_bytes():  # an exited (zombie) process has none
                    pids.append(int(cmdline.parent.name))
            except (OSError, ValueError):
                pass  # gone already
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)


@contextmanager
def simulated_cluster(head_cpus: int) -> Iterator[SimulatedCluster]:
    """A head node (``head_cpus`` logical CPUs, no dashboard) this process joins; add worker
    nodes with :meth:`SimulatedCluster.add_node`.  Everything is shut down on exit."""
    import ray
    from ray._common.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    from prvrlab.platform.runtime import _local_node_ip

    ray.shutdown()
    _local_node_ip("127.0.0.1")  # keep the loopback node IP (Ray would swap in the machine's address)
    temp_dir = Path("/tmp") / f"ray_prvrlab_sim_{os.getpid()}_{free_ports(1)[0]}"  # short: socket paths
    # Cluster writes the head's address into Ray's default temp folder (ray_current_cluster) whatever
    # folder its nodes use; on a machine where Ray never ran, that folder does not exist yet.
    Path(get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
    try:
        cluster = Cluster(  # no exit hooks: they set signal handlers, so nodes could not join from another thread
            initialize_head=True,
            shutdown_at_exit=False,
            head_node_args={"num_cpus": head_cpus, "node_ip_address": "127.0.0.1", "include_dashboard": False, "temp_dir": str(temp_dir)},
        )
    except BaseException:  # the head's processes may have started: none may outlive the test
        kill_processes_under(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        yield SimulatedCluster(cluster, temp_dir)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def trial_nodes(results: Path) -> dict[str, set[str]]:
    """trial id -> the Ray node ids its actor / ranks ran on (all attempts; the trials' ``nodes.txt``)."""
    from prvrlab.platform.search.study import NODES_FILE

    nodes: dict[str, set[str]] = {}
    for path in results.glob(f"search/*/*/trials/*/files/{NODES_FILE}"):
        trial = path.parent.parent.name
        nodes[trial] = {line.split()[1] for line in path.read_text().splitlines() if line.strip()}
    return nodes
