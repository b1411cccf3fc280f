"""
A PostgreSQL server of the test's own, which the test may stop and start again.

``initdb`` makes a cluster in a temporary directory (trust authentication, user
``postgres``) and ``pg_ctl`` runs it on a free loopback port, its socket in that
directory; as root both run as the ``postgres`` user (``initdb`` refuses root).
:meth:`PrivatePostgres.stop` stops it in ``immediate`` mode by default: every
server process exits at once, open transactions die uncommitted, and the next
start recovers from the WAL, as after a crash. The shared PostgreSQL on 5432 is
never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.faults import freeze_process

__all__ = ["PrivatePostgres", "PrivatePostgresUnavailable", "private_postgres"]

#: A cold start on a loaded 2-core machine; a stop in immediate mode is near instant.
_TIMEOUT = 120


class PrivatePostgresUnavailable(RuntimeError):
    """initdb or pg_ctl missing, or the cluster did not start."""


class PrivatePostgres:
    """One cluster: :meth:`start`, :meth:`stop` (immediate), :meth:`start` again, :meth:`close`."""

    def __init__(self) -> None:
        for tool in ("initdb", "pg_ctl"):
            if shutil.which(tool) is None:
                raise PrivatePostgresUnavailable(f"{tool} is not installed")
        self.directory = Path(tempfile.mkdtemp(prefix="idemflow-pg-"))
        self.data = self.directory / "data"
        self.port = _free_port()
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:  # initdb refuses root: the cluster is the postgres user's
            self._as = {"user": "postgres", "group": "postgres", "extra_groups": []}
            self.directory.chmod(0o755)
            shutil.chown(self.directory, "postgres", "postgres")
        try:
            cluster = ["-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8"]
            self._run(["initdb", *cluster, "--locale=C", "--no-sync", "--no-instructions"])
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1"
        options += " -c fsync=off -c full_page_writes=off"  # a test's data: no disk flushes
        log = self.directory / "server.log"
        self._run(["pg_ctl", "-D", str(self.data), "-l", str(log), "-o", options, "-w", "start"])

    def stop(self, mode: str = "immediate") -> None:
        """Stop the server (pg_ctl signals the postmaster named in ``postmaster.pid``)."""
        self._run(["pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop"])

    def freeze(self) -> None:
        """Stop every server process (SIGSTOP): the postmaster, then its children. The
        kernel still takes what clients send; nothing answers until :meth:`thaw`."""
        for pid in self._processes():
            freeze_process(pid)

    def thaw(self) -> None:
        """Resume every server process (SIGCONT): it runs what it was sent meanwhile."""
        for pid in reversed(self._processes()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _processes(self) -> list[int]:
        """The postmaster (first line of ``postmaster.pid``) and its children."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError):
                    fields = (entry / "stat").read_text().rpartition(")")[2].split()
                    if int(fields[1]) == postmaster:
                        children.append(int(entry.name))
        return [postmaster, *children]

    def close(self) -> None:
        """Stop the server if it runs (thawed first), and remove its files."""
        if (self.data / "postmaster.pid").exists():
            with contextlib.suppress(OSError, ValueError):
                self.thaw()
            with contextlib.suppress(PrivatePostgresUnavailable):
                self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            text = (self.directory / "server.log").read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return "(no server log)"

    def _run(self, args: list[str]) -> None:
        done = subprocess.run(
            args, capture_output=True, text=True, timeout=_TIMEOUT, check=False, **self._as
        )
        if done.returncode != 0:
            said = (done.stdout + done.stderr)[-2000:]
            raise PrivatePostgresUnavailable(f"{' '.join(args[:2])} failed: {said}")


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """A started private cluster, stopped and removed at the end."""
    cluster = PrivatePostgres()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
