"""
A MariaDB that offers TLS, for the tests of the MySQL stores' ``ssl-mode``.

The shared MariaDB on 3306 offers none (``have_ssl = DISABLED``) and is never
reconfigured, so this starts one ``mariadbd`` of its own
(:class:`~tests._private_mariadb.PrivateMariaDB`: a free loopback port, a datadir
from ``mariadb-install-db`` in a temporary directory, running as ``mysql``) with a
certificate for ``IP:127.0.0.1`` only (not ``localhost``) signed by a CA made here
with ``openssl``. :func:`tls_server` is a context manager; the server is stopped
by its PID and its files removed as it exits.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests._private_mariadb import PrivateMariaDB, PrivateMariaDBUnavailable


class TLSServerUnavailable(PrivateMariaDBUnavailable):
    """openssl missing (the server's own failures are :class:`PrivateMariaDBUnavailable`)."""


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
    if shutil.which("openssl") is None:
        raise TLSServerUnavailable("openssl is not installed")
    directory = Path(tempfile.mkdtemp(prefix="idemflow-tls-"))
    try:
        _certificates(directory)
        for pem in directory.glob("*.pem"):
            pem.chmod(0o644)  # the server runs as mysql
        certificates = ("ca.pem", "server.pem", "server-key.pem")
        options = ("ssl-ca", "ssl-cert", "ssl-key")
        extra = tuple(f"{o}={directory / c}" for o, c in zip(options, certificates, strict=True))
        server = PrivateMariaDB(directory, extra)  # removes the directory as it closes
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    try:
        server.start()
        yield TLSServer(server.port, directory / "ca.pem", directory / "other-ca.pem")
    finally:
        server.close()
