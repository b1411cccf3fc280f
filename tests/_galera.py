"""
A real MariaDB Galera cluster for the tests: three primaries on free loopback ports.

Each node is ``mariadbd`` with a datadir of its own (``mariadb-install-db``)
in one temporary directory, running as the ``mysql`` user (rsync state
transfer refuses root), with ``wsrep_provider`` = the galera-4 library and
``wsrep_cluster_address = gcomm://`` every node. The first node bootstraps
the cluster (``--wsrep-new-cluster``); the others join it by state transfer
(rsync). We wait until every node reports ``wsrep_cluster_size`` = 3 and
``Synced``. :func:`shared_cluster` starts one per test session on first use
and :func:`stop_shared_cluster` (called at session end) stops every node by
its PID and removes the files. The shared MariaDB on 3306 is never touched.

``wsrep_retry_autocommit = 0``: the server does not retry an autocommit
statement that failed certification, so every conflict reaches the store,
which must handle it (the default, 1, hides most of them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["GaleraCluster", "GaleraUnavailable", "shared_cluster", "stop_shared_cluster"]

NODES = 3
PROVIDER = Path("/usr/lib/galera/libgalera_smm.so")
#: A cold start is ~10 s here; a loaded 2-core machine can take several times that.
_READY_TIMEOUT = 180.0
_STOP_TIMEOUT = 60.0
DATABASE = "test"


class GaleraUnavailable(RuntimeError):
    """mariadbd or galera-4 missing, or the cluster did not become synced."""


@dataclass
class GaleraNode:
    name: str
    directory: Path
    #: client, group communication (gcomm), incremental and full state transfer.
    port: int
    gcomm_port: int
    ist_port: int
    sst_port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mysql://root@127.0.0.1:{self.port}/{DATABASE}"

    @property
    def config(self) -> Path:
        return self.directory.parent / f"{self.name}.cnf"

    def log_tail(self, lines: int = 15) -> str:
        log = self.directory / "error.log"
        with contextlib.suppress(OSError):
            return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        return "(no error log)"


@dataclass
class GaleraCluster:
    """The running nodes and the directory holding their datadirs and configs."""

    directory: Path
    nodes: list[GaleraNode] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @classmethod
    def start(cls, size: int = NODES) -> GaleraCluster:
        _check_installed()
        directory = Path(tempfile.mkdtemp(prefix="idemflow-galera-"))
        directory.chmod(0o755)  # the nodes run as mysql: they must reach their datadirs
        ports = _free_ports(4 * size)
        cluster = cls(directory)
        for n in range(size):
            port, gcomm, ist, sst = ports[4 * n : 4 * n + 4]
            cluster.nodes.append(
                GaleraNode(f"n{n + 1}", directory / f"n{n + 1}", port, gcomm, ist, sst)
            )
        try:
            cluster._boot()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _boot(self) -> None:
        address = "gcomm://" + ",".join(f"127.0.0.1:{n.gcomm_port}" for n in self.nodes)
        name = f"idemflow_{self.nodes[0].gcomm_port}"
        for node in self.nodes:
            _install(node, address, name)
        first, *others = self.nodes
        _launch(first, "--wsrep-new-cluster")
        _wait(lambda: _status(first, "wsrep_ready") == "ON", first, "bootstrap")
        with _connect(first, database=None) as conn, conn.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE IF NOT EXISTS {DATABASE}")
        for node in others:
            _launch(node)
        for node in self.nodes:
            _wait(_synced(node, len(self.nodes)), node, "Synced")

    def stop(self) -> None:
        """SIGKILL every node by its PID, then remove the files.

        Nothing in the cluster is kept, and a clean shutdown of three nodes
        leaving the group one by one takes ~20 s here.
        """
        running = [n.process for n in self.nodes if n.process is not None]
        for process in running:
            if process.poll() is None:
                process.kill()
        for process in running:
            process.wait(timeout=_STOP_TIMEOUT)
        for node in self.nodes:
            node.process = None
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> GaleraCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _check_installed() -> None:
    if shutil.which("mariadbd") is None or shutil.which("mariadb-install-db") is None:
        raise GaleraUnavailable("mariadb-server (mariadbd, mariadb-install-db) is not installed")
    if not PROVIDER.exists():
        raise GaleraUnavailable(f"galera-4 is not installed ({PROVIDER} missing)")
    if shutil.which("rsync") is None:
        raise GaleraUnavailable("rsync (the state transfer method) is not installed")
    if os.geteuid() != 0:
        raise GaleraUnavailable("the nodes must run as user mysql: start the tests as root")


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free now: all bound at once, so none repeats."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


def _install(node: GaleraNode, address: str, name: str) -> None:
    """A fresh datadir; tried twice (it failed once here, seen only under a load of ~40)."""
    node.config.write_text(_config(node, address, name))
    failure = ""
    for _ in range(2):
        shutil.rmtree(node.directory, ignore_errors=True)
        node.directory.mkdir()
        shutil.chown(node.directory, "mysql", "mysql")
        failure = _install_db(node)
        if not failure:
            return
    raise GaleraUnavailable(f"mariadb-install-db failed: {failure}")


def _install_db(node: GaleraNode) -> str:
    """Run mariadb-install-db; what it said if it failed, else an empty string."""
    done = subprocess.run(
        [
            "mariadb-install-db",
            f"--defaults-file={node.config}",
            "--user=mysql",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
        ],
        capture_output=True,
        timeout=120,
        check=False,
    )
    if done.returncode == 0:
        return ""
    # Its warnings come last; the error is usually among the lines before them.
    said = [line for line in (done.stdout + done.stderr).decode(errors="replace").splitlines()
            if "[Warning]" not in line]  # fmt: skip
    return f"exit {done.returncode}: " + "\n".join(said[-30:])


def _config(node: GaleraNode, address: str, name: str) -> str:
    provider_options = ";".join(
        [
            f"base_port={node.gcomm_port}",
            f"ist.recv_addr=127.0.0.1:{node.ist_port}",
            "gcache.size=64M",
            # How soon a silent node is suspected, then dropped: a partition test
            # waits this long; shorter would evict nodes of a merely loaded machine.
            "evs.suspect_timeout=PT3S",
            "evs.inactive_timeout=PT10S",
        ]
    )
    directory = node.directory
    return f"""[mysqld]
user=mysql
datadir={directory}
socket={directory}/mysqld.sock
pid-file={directory}/mysqld.pid
log-error={directory}/error.log
# Its own temporary files: a starting mariadbd deletes every #sql file in its tmpdir,
# and in /tmp those are the shared server's (its temporary tables failed mid-query).
tmpdir={directory}
port={node.port}
bind-address=127.0.0.1
skip-name-resolve
performance_schema=OFF
innodb_buffer_pool_size=64M
innodb_log_file_size=32M
# The cluster, not one node's fsync, makes a commit durable (the usual Galera setting).
innodb_flush_log_at_trx_commit=2
# What Galera requires:
binlog_format=ROW
default_storage_engine=InnoDB
innodb_autoinc_lock_mode=2
wsrep_on=ON
wsrep_provider={PROVIDER}
# Galera caps the name at 32 bytes; unique per cluster (its first node's port).
wsrep_cluster_name={name}
wsrep_cluster_address={address}
wsrep_node_name={node.name}
wsrep_node_address=127.0.0.1:{node.gcomm_port}
wsrep_provider_options="{provider_options}"
wsrep_sst_method=rsync
wsrep_sst_receive_address=127.0.0.1:{node.sst_port}
# Every certification failure of an autocommit statement reaches the client.
wsrep_retry_autocommit=0
"""


def _launch(node: GaleraNode, *extra: str) -> None:
    command = ["mariadbd", f"--defaults-file={node.config}", *extra]
    node.process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


@contextlib.contextmanager
def _connect(node: GaleraNode, database: str | None = DATABASE) -> Iterator[Any]:
    import pymysql

    conn = pymysql.connect(
        host="127.0.0.1",
        port=node.port,
        user="root",
        database=database,
        autocommit=True,
        connect_timeout=2,
    )
    try:
        yield conn
    finally:
        conn.close()


def status(node: GaleraNode, name: str) -> str | None:
    """One ``SHOW STATUS`` value of a node, or None if it cannot answer."""
    return _status(node, name)


def _status(node: GaleraNode, name: str) -> str | None:
    try:
        with _connect(node, database=None) as conn, conn.cursor() as cursor:
            cursor.execute("SHOW STATUS LIKE %s", (name,))
            row = cursor.fetchone()
    except Exception:  # not up yet: the caller polls
        return None
    return None if row is None else str(row[1])


def _synced(node: GaleraNode, size: int) -> Callable[[], bool]:
    def synced() -> bool:
        state = _status(node, "wsrep_local_state_comment")
        return state == "Synced" and _status(node, "wsrep_cluster_size") == str(size)

    return synced


def _wait(ready: Callable[[], bool], node: GaleraNode, what: str) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT
    while time.monotonic() < deadline:
        if node.process is not None and node.process.poll() is not None:
            msg = f"node {node.name} exited ({node.process.returncode}) before {what}:\n"
            raise GaleraUnavailable(msg + node.log_tail())
        if ready():
            return
        time.sleep(0.2)
    raise GaleraUnavailable(f"timed out waiting for {node.name}: {what}\n{node.log_tail()}")


def set_isolated(index: int, isolated: bool) -> None:
    """Cut node ``index`` of the shared cluster off the group (``gmcast.isolate``), or
    let it rejoin and wait until it is synced again: a network partition, in-process."""
    cluster = shared_cluster()
    node = cluster.nodes[index]
    with _connect(node, database=None) as conn, conn.cursor() as cursor:
        cursor.execute(f"SET GLOBAL wsrep_provider_options = 'gmcast.isolate={int(isolated)}'")
    if isolated:
        _wait(lambda: _status(node, "wsrep_cluster_status") == "non-Primary", node, "cut off")
    else:
        for member in cluster.nodes:
            _wait(_synced(member, len(cluster.nodes)), member, "Synced after rejoining")


_shared: list[GaleraCluster] = []  # at most one
_failed: list[BaseException] = []  # why it could not start: tried once per session


def shared_cluster() -> GaleraCluster:
    """One cluster per test session, started on first use (and tried only once)."""
    if _failed:
        raise GaleraUnavailable(str(_failed[0]))
    if not _shared:
        try:
            _shared.append(GaleraCluster.start())
        except (GaleraUnavailable, OSError) as exc:
            _failed.append(exc)
            raise
    return _shared[0]


def stop_shared_cluster() -> None:
    while _shared:
        _shared.pop().stop()
