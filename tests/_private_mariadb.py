"""
A MariaDB server of the test's own, which the test may kill and start again.

``mariadb-install-db`` makes a datadir in a temporary directory (``root`` with no
password, as the shared server) and ``mariadbd`` serves it on a free loopback port,
its socket in that datadir; as root it runs as the ``mysql`` user. It is started
with no ``mysqld_safe`` in front, so its PID is the server's own:
:meth:`PrivateMariaDB.stop` sends it SIGKILL (the analogue of PostgreSQL's
immediate mode: every connection drops at once, open transactions die uncommitted,
and the next start recovers them from the redo log, as after a crash) and
:meth:`PrivateMariaDB.start` serves the same datadir on the same port again. The
shared MariaDB on 3306 is never touched.

``extra`` lines go to the server's ``[mysqld]`` section (``tests/_tls_mariadb.py``
adds its certificates there).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests._galera import _free_ports
from tests.faults import freeze_process

__all__ = ["PrivateMariaDB", "PrivateMariaDBUnavailable", "private_mariadb"]

#: A cold start on a loaded 2-core machine (a few seconds here, idle).
_TIMEOUT = 120.0
DATABASE = "test"


class PrivateMariaDBUnavailable(RuntimeError):
    """mariadbd or mariadb-install-db missing, or the server did not start."""


class PrivateMariaDB:
    """One server: :meth:`start`, :meth:`stop` (SIGKILL), :meth:`start` again, :meth:`close`."""

    def __init__(self, directory: Path | None = None, extra: tuple[str, ...] = ()) -> None:
        """``directory``: where its files go (a new temporary one by default), removed by
        :meth:`close`; ``extra``: lines for its ``[mysqld]`` section."""
        for tool in ("mariadbd", "mariadb-install-db"):
            if shutil.which(tool) is None:
                raise PrivateMariaDBUnavailable(f"{tool} is not installed")
        self.directory = directory or Path(tempfile.mkdtemp(prefix="idemflow-maria-"))
        self.data = self.directory / "data"
        (self.port,) = _free_ports(1)
        self._process: subprocess.Popen[bytes] | None = None
        try:
            self._install(extra)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    @property
    def url(self) -> str:
        return f"mysql://root@127.0.0.1:{self.port}/{DATABASE}"

    @property
    def config(self) -> Path:
        return self.directory / "my.cnf"

    def start(self) -> None:
        """Start the server and wait until it accepts connections (and has ``test``)."""
        self._process = subprocess.Popen(
            ["mariadbd", f"--defaults-file={self.config}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the tests is not the server's
        )
        self._wait_ready()

    def stop(self) -> None:
        """Kill the server (SIGKILL, by its PID) and reap it: no shutdown of any kind."""
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=60)
            self._process = None

    def freeze(self) -> None:
        """Stop the server (SIGSTOP, every thread): nothing answers until :meth:`thaw`."""
        assert self._process is not None
        freeze_process(self._process.pid, _TIMEOUT)

    def thaw(self) -> None:
        """Resume the server (SIGCONT): it runs what it was sent meanwhile."""
        assert self._process is not None
        os.kill(self._process.pid, signal.SIGCONT)

    def close(self) -> None:
        """Stop the server if it runs, and remove its files."""
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            text = (self.data / "error.log").read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return "(no error log)"

    def _install(self, extra: tuple[str, ...]) -> None:
        self.data.mkdir(parents=True)
        user = []
        if os.geteuid() == 0:  # mariadbd refuses to run as root: the datadir is mysql's
            self.directory.chmod(0o755)
            shutil.chown(self.data, "mysql", "mysql")
            user = ["user=mysql"]
        lines = [
            "[mysqld]",
            *user,
            f"datadir={self.data}",
            f"socket={self.data}/mysqld.sock",
            f"pid-file={self.data}/mysqld.pid",
            f"log-error={self.data}/error.log",
            f"tmpdir={self.data}",
            f"port={self.port}",
            "bind-address=127.0.0.1",
            "skip-name-resolve",
            "performance_schema=OFF",
            "innodb_buffer_pool_size=32M",
            # A test's data: a commit is written to the redo log (so it survives a
            # SIGKILL of the server) but not flushed to disk at once.
            "innodb_flush_log_at_trx_commit=2",
            *extra,
        ]
        self.config.write_text("\n".join(lines) + "\n")
        args = ["mariadb-install-db", f"--defaults-file={self.config}"]
        args += ["--auth-root-authentication-method=normal", "--skip-test-db"]
        done = subprocess.run(args, capture_output=True, timeout=_TIMEOUT, check=False)
        if done.returncode != 0:
            said = (done.stdout + done.stderr).decode(errors="replace")[-2000:]
            raise PrivateMariaDBUnavailable(f"mariadb-install-db failed: {said}")

    def _wait_ready(self) -> None:
        import pymysql

        assert self._process is not None
        deadline = time.monotonic() + _TIMEOUT
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                said = f"exited ({self._process.returncode})"
                raise PrivateMariaDBUnavailable(f"mariadbd {said}:\n{self.log_tail()}")
            try:
                conn = pymysql.connect(
                    host="127.0.0.1",
                    port=self.port,
                    user="root",
                    connect_timeout=2,
                    ssl_disabled=True,  # the TLS server's too: the check needs no TLS
                )
            except pymysql.MySQLError:
                time.sleep(0.05)  # polling the port with a deadline
                continue
            with conn, conn.cursor() as cursor:
                # Another test's server may have taken the port first (ours then exits).
                cursor.execute("SELECT @@datadir")
                (datadir,) = cursor.fetchone() or ("",)
                if Path(datadir).resolve() != self.data.resolve():
                    time.sleep(0.05)  # polling until ours exits, with a deadline
                    continue
                cursor.execute(f"CREATE DATABASE IF NOT EXISTS {DATABASE}")
            return
        self.stop()
        said = f"did not answer on port {self.port} in {_TIMEOUT:g}s"
        raise PrivateMariaDBUnavailable(f"mariadbd {said}:\n{self.log_tail()}")


@contextlib.contextmanager
def private_mariadb(extra: tuple[str, ...] = ()) -> Iterator[PrivateMariaDB]:
    """A started private server, killed and removed at the end."""
    server = PrivateMariaDB(extra=extra)
    try:
        server.start()
        yield server
    finally:
        server.close()
