"""
A MariaDB that offers TLS, for the tests of the MySQL stores' ``ssl-mode``.

The shared MariaDB on 3306 offers none (``have_ssl = DISABLED``) and is never
reconfigured, so this starts one ``mariadbd`` of its own on a free loopback
port: a datadir from ``mariadb-install-db`` in a temporary directory, running
as ``mysql``, with a certificate for ``IP:127.0.0.1`` only (not ``localhost``) signed
by a CA made here with ``openssl``. :func:`tls_server` is a context manager;
the server is stopped by its PID and its files removed as it exits.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests._galera import _free_ports

_READY_TIMEOUT = 120.0


class TLSServerUnavailable(RuntimeError):
    """mariadbd, mariadb-install-db or openssl missing, or the server did not start."""


@dataclass(frozen=True)
class TLSServer:
    port: int
    #: The CA that signed the server's certificate (PEM), and another that did not.
    ca: Path
    other_ca: Path

    def url(self, query: str = "", host: str = "127.0.0.1") -> str:
        return f"mysql://root@{host}:{self.port}/test" + (f"?{query}" if query else "")


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def _certificates(directory: Path) -> None:
    """A CA, a server certificate it signs (naming IP 127.0.0.1 only), and a second CA."""
    for ca in ("ca", "other-ca"):
        key, cert = directory / f"{ca}-key.pem", directory / f"{ca}.pem"
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                 "-subj", f"/CN=idemflow test {ca}", "-keyout", key, "-out", cert)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", directory / "server-key.pem", "-out", directory / "server.csr")  # fmt: skip
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", directory / "server.csr", "-days", "2",
             "-CA", directory / "ca.pem", "-CAkey", directory / "ca-key.pem",
             "-CAcreateserial", "-extfile", directory / "san.cnf",
             "-out", directory / "server.pem")  # fmt: skip


@contextlib.contextmanager
def tls_server() -> Iterator[TLSServer]:
    """One MariaDB offering TLS, for the ``with`` block."""
    for tool in ("mariadbd", "mariadb-install-db", "openssl"):
        if shutil.which(tool) is None:
            raise TLSServerUnavailable(f"{tool} is not installed")
    directory = Path(tempfile.mkdtemp(prefix="idemflow-tls-"))
    process: subprocess.Popen[bytes] | None = None
    try:
        directory.chmod(0o755)
        _certificates(directory)
        for pem in directory.glob("*.pem"):
            pem.chmod(0o644)
        datadir = directory / "data"
        datadir.mkdir()
        shutil.chown(datadir, "mysql", "mysql")
        (port,) = _free_ports(1)
        config = directory / "my.cnf"
        config.write_text(f"""[mysqld]
user=mysql
datadir={datadir}
socket={datadir}/mysqld.sock
pid-file={datadir}/mysqld.pid
log-error={datadir}/error.log
tmpdir={datadir}
port={port}
bind-address=127.0.0.1
skip-name-resolve
performance_schema=OFF
innodb_buffer_pool_size=32M
ssl-ca={directory}/ca.pem
ssl-cert={directory}/server.pem
ssl-key={directory}/server-key.pem
""")
        installed = subprocess.run(
            ["mariadb-install-db", f"--defaults-file={config}", "--user=mysql",
             "--auth-root-authentication-method=normal", "--skip-test-db"],
            capture_output=True, timeout=120, check=False,
        )  # fmt: skip
        if installed.returncode != 0:
            said = (installed.stdout + installed.stderr).decode(errors="replace")[-2000:]
            raise TLSServerUnavailable(f"mariadb-install-db failed: {said}")
        process = subprocess.Popen(
            ["mariadbd", f"--defaults-file={config}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _wait_ready(process, port, datadir)
        yield TLSServer(port, directory / "ca.pem", directory / "other-ca.pem")
    finally:
        if process is not None:
            process.kill()
            process.wait(timeout=60)
        shutil.rmtree(directory, ignore_errors=True)


def _wait_ready(process: subprocess.Popen[bytes], port: int, datadir: Path) -> None:
    import pymysql

    deadline = time.monotonic() + _READY_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = (datadir / "error.log").read_text(errors="replace")[-2000:]
            raise TLSServerUnavailable(f"mariadbd exited ({process.returncode}):\n{log}")
        try:
            conn = pymysql.connect(
                host="127.0.0.1", port=port, user="root", connect_timeout=2, ssl_disabled=True
            )
        except pymysql.MySQLError:
            time.sleep(0.2)
            continue
        with conn, conn.cursor() as cursor:
            cursor.execute("CREATE DATABASE IF NOT EXISTS test")
        return
    raise TLSServerUnavailable(f"mariadbd on port {port} did not answer in {_READY_TIMEOUT:g}s")
