"""``mysql://`` URLs, as ``pymysql.connect`` arguments, and the TLS they ask for, spelt as
MySQL's clients spell it (docs/stores.md, "TLS"): one `ssl.SSLContext` per URL.
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ..._errors import ConfigurationError

_FOUND_ROWS = 2  # pymysql.constants.CLIENT.FOUND_ROWS

#: ``ssl-mode`` values, MySQL's (``mysql --ssl-mode``).
SSL_MODES = ("DISABLED", "PREFERRED", "REQUIRED", "VERIFY_CA", "VERIFY_IDENTITY")


def connect_kwargs(url: str, driver: str = "pymysql") -> dict[str, Any]:
    """``mysql://user:password@host:3306/db?found_rows=1`` → ``pymysql.connect`` (or, with
    ``driver="asyncmy"``, ``asyncmy.connect``) arguments. ``ssl-mode``: REQUIRED and
    VERIFY_* → ``ssl=`` a new context; DISABLED → off; PREFERRED or none → the
    driver's default (asyncmy cannot fall back: ConfigurationError).
    """
    if driver not in ("pymysql", "asyncmy"):
        msg = f"connect_kwargs' driver is 'pymysql' or 'asyncmy', not {driver!r}"
        raise ConfigurationError(msg)
    parts = urlsplit(url)
    database = unquote(parts.path.lstrip("/"))
    if not parts.hostname or not database:
        msg = f"MySQL URLs name a host and a database: mysql://user@host:3306/db, not {url!r}"
        raise ConfigurationError(msg)
    kwargs: dict[str, Any] = {
        "host": parts.hostname,
        "port": parts.port or 3306,
        "user": unquote(parts.username or "root"),
        "password": unquote(parts.password or ""),
        "database": database,
    }
    options = dict(parse_qsl(parts.query))
    if options.get("found_rows", "").lower() in ("1", "true", "yes"):
        kwargs["client_flag"] = _FOUND_ROWS
    mode, ca = _ssl_options(parts.query)
    if mode == "DISABLED":
        if driver == "pymysql":
            kwargs["ssl_disabled"] = True
    elif mode == "PREFERRED":
        if driver == "asyncmy":
            msg = (
                "ssl-mode=PREFERRED: asyncmy cannot fall back to plain TCP when the server "
                "offers no TLS; name REQUIRED, VERIFY_CA or VERIFY_IDENTITY to encrypt, or "
                "DISABLED (asyncmy's default)"
            )
            raise ConfigurationError(msg)
    elif mode is not None:
        kwargs["ssl"] = tls_context(mode, ca)
    return kwargs


def _ssl_options(query: str) -> tuple[str | None, str | None]:
    """The ``ssl-mode`` (None: not named) and ``ssl-ca`` a URL's query names."""
    given: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if not name.lower().startswith("ssl"):
            continue
        option = name.lower().replace("_", "-")
        if option not in ("ssl-mode", "ssl-ca"):
            msg = (
                f"MySQL URL option {name!r} is not one idemflow reads: TLS is "
                f"ssl-mode={'|'.join(SSL_MODES)} and ssl-ca=/path/ca.pem"
            )
            raise ConfigurationError(msg)
        if option in given:
            msg = f"MySQL URL option {option} is given twice"
            raise ConfigurationError(msg)
        given[option] = value
    ca = given.get("ssl-ca") or None
    if "ssl-mode" in given:
        mode = given["ssl-mode"].upper()
        if mode not in SSL_MODES:
            msg = f"ssl-mode must be one of {', '.join(SSL_MODES)}, not {given['ssl-mode']!r}"
            raise ConfigurationError(msg)
    elif ca is not None:
        mode = "VERIFY_CA"  # as MySQL's clients: a CA named, and no mode, verifies against it
    else:
        return None, None
    if ca is not None and not mode.startswith("VERIFY"):
        msg = f"ssl-ca is for ssl-mode=VERIFY_CA or VERIFY_IDENTITY, not ssl-mode={mode}"
        raise ConfigurationError(msg)
    return mode, ca


def tls_context(mode: str, ca: str | None = None) -> ssl.SSLContext:
    """The context ``ssl-mode`` ``REQUIRED``, ``VERIFY_CA`` or ``VERIFY_IDENTITY`` connects with."""
    if mode == "REQUIRED":  # no check: the CA bundle it would never consult is not loaded
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    try:
        context = ssl.create_default_context(cafile=ca)
    except OSError as exc:
        msg = f"ssl-ca {ca!r} cannot be read as PEM CA certificates: {exc}"
        raise ConfigurationError(msg) from exc
    # MySQL's self-generated certificates fail Python 3.13's strict X.509 checks.
    context.verify_flags &= ~ssl.VERIFY_X509_STRICT
    context.check_hostname = mode == "VERIFY_IDENTITY"
    context.verify_mode = ssl.CERT_REQUIRED
    return context
