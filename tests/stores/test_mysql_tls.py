"""
TLS for the MySQL stores: ``ssl-mode`` and ``ssl-ca`` in the URL, and one context per
store instead of one per connection.

Against the shared MariaDB (it offers no TLS: ``have_ssl = DISABLED``) and against a
MariaDB of this module's own that offers it (``tests/_tls_mariadb.py``, a certificate
for ``IP:127.0.0.1`` signed by a CA made here). What is asserted is what the driver
received and what the server saw (``Ssl_cipher``), never a time.

``tests/__init__.py`` turns PyMySQL's TLS off for the connections the tests open
themselves; every test here turns it back on.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator
from typing import Any

import pytest

from idemflow import ConfigurationError
from tests.backends import MYSQL_URL
from tests.conftest import unreachable

pymysql = pytest.importorskip("pymysql")

from idemflow.stores.mysql import AsyncMySQLStore, MySQLStore, connect_kwargs  # noqa: E402
from tests._private_mariadb import PrivateMariaDBUnavailable  # noqa: E402
from tests._tls_mariadb import TLSServer, tls_server  # noqa: E402

pytestmark = [pytest.mark.mysql, pytest.mark.usefixtures("pymysql_ssl")]

BASE = "mysql://root@127.0.0.1:3306/test"


@pytest.fixture
def pymysql_ssl(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyMySQL's TLS back on (``tests/__init__.py`` turns it off): its ``PREFERRED``
    default, and any ``ssl`` argument at all (else refused: "ssl module not found")."""
    monkeypatch.setattr(pymysql.connections, "SSL_ENABLED", True)


def cipher(conn: Any) -> str:
    with conn.cursor() as cursor:
        cursor.execute("SHOW STATUS LIKE 'Ssl_cipher'")
        return str(cursor.fetchone()[1])


async def acipher(conn: Any) -> str:
    async with conn.cursor() as cursor:
        await cursor.execute("SHOW STATUS LIKE 'Ssl_cipher'")
        row = await cursor.fetchone()
        return str(row[1])


@contextlib.contextmanager
def checked_out(store: MySQLStore, count: int) -> Iterator[list[Any]]:
    """``count`` of the store's connections at once: each one opened anew."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(store.pool.connection()) for _ in range(count)]


# --- the URL's options ----------------------------------------------------------------


def test_no_ssl_mode_gives_no_tls_argument() -> None:
    kwargs = connect_kwargs(BASE)
    assert not {"ssl", "ssl_disabled"} & kwargs.keys()
    assert not {"ssl", "ssl_disabled"} & connect_kwargs(BASE, "asyncmy").keys()


@pytest.mark.parametrize("spelling", ["ssl-mode", "ssl_mode", "SSL-MODE"])
def test_disabled_is_each_drivers_spelling(spelling: str) -> None:
    url = f"{BASE}?{spelling}=disabled"
    assert connect_kwargs(url)["ssl_disabled"] is True
    assert not {"ssl", "ssl_disabled"} & connect_kwargs(url, "asyncmy").keys()


def test_each_encrypting_mode_is_one_context_with_its_checks() -> None:
    required = connect_kwargs(f"{BASE}?ssl-mode=REQUIRED")["ssl"]
    assert isinstance(required, ssl.SSLContext)
    assert (required.verify_mode, required.check_hostname) == (ssl.CERT_NONE, False)
    verify_ca = connect_kwargs(f"{BASE}?ssl-mode=VERIFY_CA", "asyncmy")["ssl"]
    assert (verify_ca.verify_mode, verify_ca.check_hostname) == (ssl.CERT_REQUIRED, False)
    identity = connect_kwargs(f"{BASE}?ssl-mode=verify_identity")["ssl"]
    assert (identity.verify_mode, identity.check_hostname) == (ssl.CERT_REQUIRED, True)
    assert "ssl" not in connect_kwargs(f"{BASE}?ssl-mode=PREFERRED")  # PyMySQL's default


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("ssl-mode=ON", "ssl-mode"),
        ("ssl-mode=", "ssl-mode"),
        ("ssl=false", "'ssl'"),
        ("sslmode=require", "'sslmode'"),
        ("ssl-cert=/c.pem", "'ssl-cert'"),
        ("ssl-mode=REQUIRED&ssl_mode=DISABLED", "ssl-mode is given twice"),
        ("ssl-mode=REQUIRED&ssl-ca=/ca.pem", "ssl-ca"),
        ("ssl-ca=/nonexistent/ca.pem", "ssl-ca '/nonexistent/ca.pem'"),
    ],
)
def test_a_bad_tls_option_is_a_configuration_error_naming_it(query: str, named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        MySQLStore(f"{BASE}?{query}")
    with pytest.raises(ConfigurationError, match=named):
        AsyncMySQLStore(f"{BASE}?{query}")


def test_asyncmy_refuses_preferred() -> None:
    """asyncmy has no fallback to plain TCP: PREFERRED would be a promise it cannot keep."""
    with pytest.raises(ConfigurationError, match="ssl-mode=PREFERRED"):
        AsyncMySQLStore(f"{BASE}?ssl-mode=PREFERRED")
    with pytest.raises(ConfigurationError, match="driver"):
        connect_kwargs(BASE, "mysqlclient")


# --- the shared MariaDB (no TLS) ------------------------------------------------------


@pytest.fixture
def reachable() -> None:
    try:
        pymysql.connect(**connect_kwargs(MYSQL_URL), connect_timeout=3).close()
    except pymysql.err.OperationalError as exc:
        unreachable("MariaDB", exc)


@pytest.mark.usefixtures("reachable")
def test_disabled_reaches_pymysql_and_the_connection_works() -> None:
    store = MySQLStore(f"{MYSQL_URL}?ssl-mode=DISABLED")
    with checked_out(store, 2) as conns:
        assert all(conn.ssl is False for conn in conns)  # never offered, never asked
        assert not hasattr(conns[0], "ctx")
        assert cipher(conns[0]) == ""
    store.close()


@pytest.mark.usefixtures("reachable")
def test_a_stores_pymysql_connections_share_one_preferred_context() -> None:
    """PyMySQL's default (PREFERRED) still asks for TLS, with the context PyMySQL would
    build (nothing verified), built once: every connection of every store holds it."""
    store, other = MySQLStore(MYSQL_URL), MySQLStore(connect_kwargs(MYSQL_URL))
    with checked_out(store, 3) as conns, checked_out(other, 2) as others:
        contexts = {id(conn.ctx) for conn in conns + others}
        assert len(contexts) == 1
        assert all(conn.ssl is True and conn._ssl_required is False for conn in conns)
        context = conns[0].ctx
        assert (context.verify_mode, context.check_hostname) == (ssl.CERT_NONE, False)
        assert cipher(conns[0]) == ""  # the server offers none: plain TCP
    store.close()
    other.close()


@pytest.mark.usefixtures("reachable")
def test_required_against_a_server_without_tls_fails_rather_than_going_plain() -> None:
    store = MySQLStore(f"{MYSQL_URL}?ssl-mode=REQUIRED")
    with pytest.raises(Exception, match="SSL is required"), store.pool.connection():
        pass
    store.close()


@pytest.mark.anyio
@pytest.mark.usefixtures("reachable")
async def test_async_disabled_and_default_are_plain_tcp() -> None:
    for url in (MYSQL_URL, f"{MYSQL_URL}?ssl-mode=DISABLED"):
        store = AsyncMySQLStore(url)
        async with store.pool.connection() as conn:
            assert conn._ssl_context is None
            assert await acipher(conn) == ""
        await store.close()
    # PyMySQL's spelling, in a dict of arguments: asyncmy has no ssl_disabled, it is taken.
    store = AsyncMySQLStore({**connect_kwargs(f"{MYSQL_URL}?ssl-mode=DISABLED")})
    async with store.pool.connection() as conn:
        assert await acipher(conn) == ""
    await store.close()


# --- a MariaDB that offers TLS --------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[TLSServer]:
    try:
        with tls_server() as started:
            yield started
    except PrivateMariaDBUnavailable as exc:  # TLSServerUnavailable (no openssl) is one
        unreachable("a MariaDB offering TLS", exc)


@pytest.mark.slow
def test_preferred_default_still_encrypts_with_the_shared_context(server: TLSServer) -> None:
    """No security change: the context built once is the one every connection encrypts with."""
    store = MySQLStore(server.url())
    with checked_out(store, 3) as conns:
        assert len({id(conn.ctx) for conn in conns}) == 1
        assert all(cipher(conn) for conn in conns)
    store.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "query",
    ["ssl-mode=REQUIRED", "ssl-mode=VERIFY_CA&ssl-ca={ca}", "ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}"],
)
def test_encrypting_modes_share_the_stores_context(server: TLSServer, query: str) -> None:
    store = MySQLStore(server.url(query.format(ca=server.ca)))
    with checked_out(store, 3) as conns:
        assert len({id(conn.ctx) for conn in conns}) == 1
        assert all(conn._ssl_required for conn in conns)
        assert all(cipher(conn) for conn in conns)
    store.close()


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("query", ["ssl-mode=REQUIRED", "ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}"])
async def test_async_encrypting_modes_share_the_stores_context(
    server: TLSServer, query: str
) -> None:
    store = AsyncMySQLStore(server.url(query.format(ca=server.ca)))
    async with store.pool.connection() as one, store.pool.connection() as two:
        assert one._ssl_context is two._ssl_context is not None
        assert await acipher(one)
        assert await acipher(two)
    await store.close()


@pytest.mark.slow
def test_verification_refuses_another_ca_and_another_name(server: TLSServer) -> None:
    ours, theirs = server.ca, server.other_ca
    refused = [
        server.url(f"ssl-ca={theirs}"),  # VERIFY_CA: signed by another CA
        server.url(f"ssl-mode=VERIFY_IDENTITY&ssl-ca={ours}", host="localhost"),  # not named
    ]
    for url in refused:
        store = MySQLStore(url)
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"), store.pool.connection():
            pass
        store.close()
    # The CA alone does not check the name: VERIFY_CA through "localhost" is accepted.
    store = MySQLStore(server.url(f"ssl-mode=VERIFY_CA&ssl-ca={ours}", host="localhost"))
    with store.pool.connection() as conn:
        assert cipher(conn)
    store.close()
