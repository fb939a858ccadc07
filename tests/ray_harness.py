"""Local Ray heads as subprocesses, for tests that need `ray start` (job submission, autoscaler).

Contract:
- `start_head(...)` runs `ray start --head --block` in its own session (process group) with
  every port chosen free on 127.0.0.1, a unique short `--temp-dir`, token authentication off
  (`RAY_AUTH_MODE=disabled`), the loopback-only switch, and the project's virtual environment
  first on `PATH` (`ray job submit` runs entrypoints with the head's `PATH`). It returns once
  the GCS port (and the dashboard, if asked for) answers, or raises with the head's log tail.
- Every process of the cluster — the head's group, raylets and workers of nodes the fake
  autoscaler adds, job drivers that Ray starts in sessions of their own — carries a unique
  marker in its environment (`BATON_RAY_HARNESS=<id>`), and its command line names the temp
  dir or the GCS address. `RayHead.stop()` kills the head's process group by id, then every
  remaining process of this user that carries the marker or names the temp dir or GCS
  address, by pid only, and raises if any survives. Nothing else on the machine is touched
  (no `ray stop`, no pkill).
- `ray_client_env(head)` is the environment for a client process (a driver, `baton fit`) of
  that head; `non_loopback_listeners(head.pids())` lists listening sockets of the cluster's
  processes that are not on 127.0.0.1 (tests assert it is empty).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent  # the interpreter running the tests: the project's venv
MARKER_VAR = "BATON_RAY_HARNESS"

# Ray reads these in every process it starts: no token auth on local test clusters, and node
# addresses on 127.0.0.1 only (see trainer/on_ray/local_cluster.py for why that switch works).
_RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel's choice, so parallel runs differ)."""
    return free_ports(1)[0]


def free_ports(count: int, exclude: Iterable[int] = ()) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now, none in ``exclude``. All are
    bound at once: one port at a time, the kernel may hand out a port it just released again
    (a CI run's head failed on two of its components given the same port)."""
    taken = set(exclude)
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in taken:
                taken.add(port)
                ports.append(port)
        return ports


@dataclass
class RayHead:
    port: int
    dashboard_port: int | None
    temp_dir: Path
    marker: str
    proc: subprocess.Popen
    log_path: Path
    env: dict[str, str] = field(repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        if self.dashboard_port is None:
            raise ValueError("this head was started with dashboard=False: no job submission URL")
        return f"http://127.0.0.1:{self.dashboard_port}"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def pids(self) -> list[int]:
        """Processes of this user that belong to this cluster (never this test process)."""
        return _cluster_pids(self)

    def stop(self, grace_s: float = 3.0) -> None:
        """End the head's process group, then any stray process of this cluster, by pid."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _kill_group(self.proc.pid)
            self.proc.wait(timeout=grace_s)
        _kill_group(self.proc.pid)  # workers the head's own SIGTERM handling left behind
        deadline = time.monotonic() + grace_s
        while (leftovers := self.pids()) and time.monotonic() < deadline:
            for pid in leftovers:
                _kill_pid(pid)
            time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        if leftovers:
            raise RuntimeError(f"processes of the cluster on {self.address} outlived "
                               f"SIGKILL: pids {leftovers}")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _own_pids() -> list[int]:
    """Pids of this user's processes, except this one and its ancestors (never ours to end)."""
    protected, pid = set(), os.getpid()
    while pid > 1:  # walk up the parent chain
        protected.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    uid = os.getuid()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in protected:
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _read_nul_separated(path: str) -> list[str]:
    try:
        return Path(path).read_bytes().decode(errors="replace").split("\0")
    except OSError:  # the process ended, or is not readable
        return []


def _cluster_pids(head: RayHead) -> list[int]:
    # A marker must not match a longer port number: "127.0.0.1:6379" is not "127.0.0.1:63790".
    gcs = re.compile(rf"127\.0\.0\.1:{head.port}(?!\d)")
    temp_dir = str(head.temp_dir)
    marker = f"{MARKER_VAR}={head.marker}"
    found = []
    for pid in _own_pids():
        cmdline = " ".join(_read_nul_separated(f"/proc/{pid}/cmdline"))
        if (temp_dir in cmdline or gcs.search(cmdline)
                or marker in _read_nul_separated(f"/proc/{pid}/environ")):
            found.append(pid)
    return found


def _wait_for_port(port: int, head_proc: subprocess.Popen, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if head_proc.poll() is not None:
            return False
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.3)
    return False


def _wait_for_dashboard(url: str, head_proc: subprocess.Popen, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if head_proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def start_head(
    *,
    num_cpus: float,
    port: int | None = None,
    dashboard: bool = False,
    autoscaling_config: Path | None = None,
    extra_env: dict[str, str] | None = None,
    startup_timeout_s: float = 90.0,
) -> RayHead:
    """Start `ray start --head --block` on free loopback ports; return once it answers.

    `port` (the GCS port) is chosen free unless given: a fake-autoscaler config must name it.
    """
    port = port or free_port()
    # The dashboard's and seven components' ports, distinct from each other and the GCS's.
    (dashboard_choice, client_port, node_manager_port, object_manager_port, metrics_port,
     agent_port, agent_grpc_port, runtime_env_port) = free_ports(8, exclude=[port])
    dashboard_port = dashboard_choice if dashboard else None
    temp_dir = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # short: unix socket paths
    marker = uuid.uuid4().hex[:12]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(_RAY_ENV)
    env.update(extra_env or {})
    env[MARKER_VAR] = marker
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    cmd = [
        str(VENV_BIN / "ray"), "start", "--head", "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        f"--num-cpus={num_cpus}",
        f"--temp-dir={temp_dir}",
        # Fixed defaults (10001, 52365, ...) collide with other clusters on this machine.
        f"--ray-client-server-port={client_port}",
        f"--node-manager-port={node_manager_port}",
        f"--object-manager-port={object_manager_port}",
        f"--metrics-export-port={metrics_port}",
        f"--dashboard-agent-listen-port={agent_port}",
        f"--dashboard-agent-grpc-port={agent_grpc_port}",
        f"--runtime-env-agent-port={runtime_env_port}",
        "--object-store-memory=200000000",
        "--disable-usage-stats",
    ]
    if dashboard:
        cmd += ["--include-dashboard=true", "--dashboard-host=127.0.0.1",
                f"--dashboard-port={dashboard_port}"]
    else:
        cmd += ["--include-dashboard=false"]
    if autoscaling_config is not None:
        cmd.append(f"--autoscaling-config={autoscaling_config}")
    log_path = temp_dir / "head.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    head = RayHead(port=port, dashboard_port=dashboard_port, temp_dir=temp_dir, marker=marker,
                   proc=proc, log_path=log_path, env=env)
    deadline = time.monotonic() + startup_timeout_s
    ready = _wait_for_port(port, proc, deadline)
    if ready and dashboard:
        ready = _wait_for_dashboard(head.dashboard_url, proc, deadline)
    if not ready:
        tail = head.log_tail()
        head.stop()
        raise RuntimeError(f"ray head on 127.0.0.1:{port} did not come up:\n{tail}")
    return head


def ray_client_env(head: RayHead, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a process that drives this head (`RAY_ADDRESS` set, marker carried)."""
    env = dict(head.env)
    env["RAY_ADDRESS"] = head.address
    env.update(extra_env or {})
    return env


def non_loopback_listeners(pids: Iterable[int]) -> list[str]:
    """`pid address:port` of each listening TCP socket of these processes not on loopback."""
    listening: dict[str, str] = {}  # socket inode -> "address:port"
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            listening[fields[9]] = f"{_decode_ip(address, v6)}:{int(port, 16)}"
    bad = []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
            if inode in listening and not _is_loopback(listening[inode]):
                bad.append(f"{pid} {listening[inode]}")
    return bad


def _decode_ip(hex_address: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc/net/tcp* stores each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET, raw)


def _is_loopback(address_port: str) -> bool:
    address = address_port.rsplit(":", 1)[0]
    return address in ("127.0.0.1", "::1", "::ffff:127.0.0.1")
