"""
idemflow for Flask: `Idempotency` (``Idempotency(app, db=db)``, ``@idem.protect``) runs a
view once per ``(principal, Idempotency-Key)``, its writes and the stored response in one
transaction on the app's own database; `handle_outcome_unknown` serves the WSGI middleware.
Guide: docs/frameworks/flask.md.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeAlias, TypeGuard, overload

from .. import Idempotency as Driver
from .. import Observer
from .._deprecation import moved
from .._errors import (
    ConfigurationError,
    IdempotencyError,
    IncompleteBody,
    MissingPrincipal,
    ResponseNotStorable,
)
from .._extras import optional
from .._model import Policy, Response
from ..edge import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    REQUEST_ID_HEADER,
    SAFE_METHODS,
    Edge,
    HTTPRequest,
    RoutePolicy,
    ViewEdges,
    body_cut_short,
    body_too_large,
    declared_length,
    engine_store,
    plain_callable,
    problem_for,
    raw_headers,
    request_id_from,
    sendable_headers,
    sync_replay_authorizer,
)
from ..stores.protocol import Store, Transaction
from .wsgi import (
    ReplayHook,
    _require_length,
    configured_replay_hook,
    report_from_flask,
    view_options,
)

with optional("idemflow.integrations.flask"):
    from flask import Flask, current_app, g, request
    from flask import Response as FlaskResponse
    from werkzeug.exceptions import ClientDisconnected, RequestEntityTooLarge

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine
    from sqlalchemy.orm import Session, scoped_session, sessionmaker

__all__ = ["Idempotency", "handle_outcome_unknown"]

_P = ParamSpec("_P")
_Q = ParamSpec("_Q")
#: Opens the transaction the completion is written in, for one request.
TransactionFactory = Callable[[], AbstractContextManager[Transaction]]
PrincipalGetter = Callable[[], "str | None"]


class _FlaskSQLAlchemy(Protocol):
    """What idemflow uses of Flask-SQLAlchemy's ``SQLAlchemy``: its engine and session."""

    @property
    def engine(self) -> Engine: ...
    @property
    def session(self) -> scoped_session[Any]: ...


#: The app's own database: Flask-SQLAlchemy's ``db``, a SQLAlchemy engine or sessionmaker.
_Database: TypeAlias = "_FlaskSQLAlchemy | Engine | sessionmaker[Any]"
_SESSION = "_idemflow_session"  # flask.g: the request's Session, for an engine's sessions

_CONFIG: dict[str, Any] = {
    "IDEMFLOW_STORE": None,
    "IDEMFLOW_TABLE": "idemflow_keys",
    "IDEMFLOW_REQUEST_TIMEOUT": 30,
    "IDEMFLOW_RETENTION": 86400,
    "IDEMFLOW_SINGLE_COMMIT": False,
    "IDEMFLOW_MAX_BODY_BYTES": DEFAULT_MAX_BODY_BYTES,
    "IDEMFLOW_MAX_RESPONSE_BYTES": DEFAULT_MAX_RESPONSE_BYTES,
    "IDEMFLOW_AUTHORIZE_REPLAY": None,  # a callable (record) -> bool, or its import path
    "IDEMFLOW_EXCLUDE_FIELDS": (),  # JSON members left out of the fingerprint
    "IDEMFLOW_STRICT_KEY": False,  # only the quoted sf-string form of the key
}


def _flask_login_user() -> str | None:
    """The default principal: Flask-Login's ``current_user.get_id()`` when authenticated."""
    from flask_login import current_user

    if not getattr(current_user, "is_authenticated", False):
        return None
    identity = current_user.get_id()
    return None if identity is None else str(identity)


_ANONYMOUS = "authenticate first: idempotency keys are scoped to the caller"


def _field_names(given: Any) -> tuple[str, ...]:
    """``IDEMFLOW_EXCLUDE_FIELDS``: names, never one string read as its letters."""
    if isinstance(given, str):
        msg = f"IDEMFLOW_EXCLUDE_FIELDS must be a list of field names, not the str {given!r}"
        raise ConfigurationError(msg)
    return tuple(given)


class _State:
    """What one app's requests share: the driver on its store, its edges, and how to open
    transactions."""

    def __init__(
        self,
        store: Store,
        policy: Policy,
        app: Flask,
        observer: Observer | None,
        authorize_replay: ReplayHook | None,
    ) -> None:
        self.store = store
        self.driver = Driver(store, policy)
        if observer is not None:
            self.driver.observer = observer
        self.single_commit = bool(app.config["IDEMFLOW_SINGLE_COMMIT"])
        _field_names(app.config["IDEMFLOW_EXCLUDE_FIELDS"])  # not a str read as its letters
        self.options = view_options(lambda name: app.config[f"IDEMFLOW_{name.upper()}"])
        self.authorize_replay = authorize_replay
        self._edges = ViewEdges(functools.partial(Edge, self.driver), self.options)
        for public in (False, True):
            self.edge(public)

    def edge(
        self,
        public: bool,
        authorize_replay: ReplayHook | None = None,
        policy: RoutePolicy | None = None,
    ) -> Edge:
        """The edge of a public or non-public view, with the view's own replay hook or
        the app's, and the view's policy or the app's."""
        hook = self.authorize_replay if authorize_replay is None else authorize_replay
        return self._edges(public, hook, policy)


class _Protector(Protocol):
    """``@idem.protect(…)``: a decorator keeping the view's parameters."""

    def __call__(self, view: Callable[_P, object], /) -> Callable[_P, FlaskResponse]: ...


class Idempotency:
    """The Flask extension: ``Idempotency(app)`` or ``Idempotency()`` then ``init_app(app)``
    (docs/frameworks/flask.md, "Configuration").

    Args:
        db: the app's own database (Flask-SQLAlchemy's ``SQLAlchemy``, a SQLAlchemy
            ``Engine`` or ``sessionmaker``): the completion is written in its session's
            transaction, the key table there unless ``IDEMFLOW_STORE`` names another.
        transaction: instead of ``db``, opens the transaction the view writes in; without
            either, the completion is written after the view returned (the weaker mode).
        store: a store object instead of ``IDEMFLOW_STORE``.
        principal: returns the caller's id (None when anonymous).
        observer: told every outcome of every protected request.
        authorize_replay: ``(record) -> bool`` (plain, not ``async def``), asked before a
            replay (False: 403); or ``IDEMFLOW_AUTHORIZE_REPLAY``, not both.
    """

    def __init__(
        self,
        app: Flask | None = None,
        *,
        db: _Database | None = None,
        transaction: TransactionFactory | None = None,
        store: Store | None = None,
        principal: PrincipalGetter | None = None,
        observer: Observer | None = None,
        authorize_replay: ReplayHook | None = None,
    ) -> None:
        if db is not None and transaction is not None:
            raise ConfigurationError("pass db= or transaction=, not both")
        if authorize_replay is not None:
            sync_replay_authorizer(authorize_replay, "Idempotency(authorize_replay=…)")
        self._authorize_replay = authorize_replay
        self.db = db
        """The app's database, as given to ``db=`` (None without one)."""
        self._transaction = transaction if db is None else _session_transactions(db)
        self._store = store
        self._principal = (
            None
            if principal is None
            else plain_callable(principal, "Idempotency(principal=…)", "() -> str | None")
        )
        self._observer = observer
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Set ``app`` up (application factories): its ``IDEMFLOW_*`` defaults, its key store
        and the ``flask idemflow`` commands. ConfigurationError: a setting out of range, or
        no ``principal=`` and no Flask-Login login manager (never claimed anonymously)."""
        for key, value in _CONFIG.items():
            app.config.setdefault(key, value)
        policy = Policy(
            request_timeout=app.config["IDEMFLOW_REQUEST_TIMEOUT"],
            retention=app.config["IDEMFLOW_RETENTION"],
        )
        if self._principal is None and getattr(app, "login_manager", None) is None:
            msg = (
                "Idempotency needs the caller's identity: pass principal=… or set up "
                "Flask-Login (keys are never claimed anonymously)"
            )
            raise ConfigurationError(msg)
        hook = self._replay_hook(app)
        store = self._store or self._open_store(app, policy)
        app.extensions["idemflow"] = _State(store, policy, app, self._observer, hook)
        app.cli.add_command(_cli(self))

    def _replay_hook(self, app: Flask) -> ReplayHook | None:
        """``authorize_replay=`` or ``IDEMFLOW_AUTHORIZE_REPLAY`` (imported if a path), checked."""
        configured = app.config["IDEMFLOW_AUTHORIZE_REPLAY"]
        if configured is None:
            return self._authorize_replay
        if self._authorize_replay is not None:
            msg = "pass authorize_replay= or set IDEMFLOW_AUTHORIZE_REPLAY, not both"
            raise ConfigurationError(msg)
        return configured_replay_hook(configured, "IDEMFLOW_AUTHORIZE_REPLAY")

    @overload
    def protect(
        self,
        view: Callable[_P, object],
        *,
        public: bool = False,
        validate: Callable[..., object] | None = None,
        authorize_replay: ReplayHook | None = None,
        policy: RoutePolicy | None = None,
    ) -> Callable[_P, FlaskResponse]: ...

    @overload
    def protect(
        self,
        view: None = None,
        *,
        public: bool = False,
        validate: Callable[..., object] | None = None,
        authorize_replay: ReplayHook | None = None,
        policy: RoutePolicy | None = None,
    ) -> _Protector: ...

    def protect(
        self,
        view: Callable[_P, object] | None = None,
        *,
        public: bool = False,
        validate: Callable[..., object] | None = None,
        authorize_replay: ReplayHook | None = None,
        policy: RoutePolicy | None = None,
    ) -> Callable[_P, FlaskResponse] | _Protector:
        """Protect a view (``@idem.protect``, or ``@idem.protect(…)``), its parameters kept.
        ``validate`` is called with them before the claim (what it raises is never recorded);
        ``authorize_replay`` and ``policy`` (a [`Policy`][idemflow.Policy] within the app's,
        or ``(principal) -> Policy``) are this view's own."""
        if authorize_replay is not None:
            sync_replay_authorizer(authorize_replay, "@idem.protect(authorize_replay=…)")

        def decorate(inner: Callable[_Q, object]) -> Callable[_Q, FlaskResponse]:
            @functools.wraps(inner)
            def wrapper(*args: _Q.args, **kwargs: _Q.kwargs) -> FlaskResponse:
                # An async view (or validate) is run to its end as Flask runs one
                # (ensure_sync: asgiref's async_to_sync), in the request's context.
                view = current_app.ensure_sync(inner)
                check = None if validate is None else current_app.ensure_sync(validate)
                return self._protected(
                    lambda: view(*args, **kwargs),
                    public,
                    None if check is None else lambda: check(*args, **kwargs),
                    authorize_replay,
                    policy,
                )

            return wrapper

        return decorate if view is None else decorate(view)

    def _state(self, app: Flask | None = None) -> _State:
        found = (app or current_app).extensions.get("idemflow")
        if not isinstance(found, _State):
            raise ConfigurationError("Idempotency.init_app(app) was not called for this app")
        return found

    def _protected(
        self,
        view: Callable[[], Any],
        public: bool,
        validate: Callable[[], object] | None,
        authorize_replay: ReplayHook | None,
        policy: RoutePolicy | None = None,
    ) -> FlaskResponse:
        state = self._state()
        # Once: every access through the request proxy costs a context lookup.
        current: Any = request._get_current_object()  # type: ignore[attr-defined]
        headers = raw_headers(current.environ)
        rid = request_id_from(headers)
        try:
            edge = state.edge(public, authorize_replay, policy)  # a bad policy: a 500 problem
            if current.method.upper() in SAFE_METHODS:
                msg = f"{current.method} is idempotent already; protect unsafe methods only"
                raise ConfigurationError(msg)
            who = (self._principal or _flask_login_user)()
            if not who and not public:
                raise MissingPrincipal(_ANONYMOUS)
            rule = current.url_rule
            http = HTTPRequest(
                current.method,
                rule.rule if rule is not None else current.path,
                headers,
                _body(state.options.max_body_bytes),
                who,
                rid,
                {str(k): str(v) for k, v in (current.view_args or {}).items()},
                current.query_string.decode("latin-1"),
            )
        except IdempotencyError as exc:
            return _to_flask(problem_for(exc, rid))
        if validate is not None:
            validate()
        made: list[FlaskResponse] = []
        read: list[Response] = []

        def reader(returned: Any) -> Response:
            # After the view ran, on the edge's side of the line: what fails here (a
            # value Flask makes no response of, a streamed body) never releases the key
            # where the view's effect stays (no transaction): a response-not-stored marker.
            made.append(current_app.make_response(returned))
            read.append(_from_flask(made[0]))
            return read[0]

        answer = edge.respond(
            http,
            lambda attempt: view(),
            transaction=self._transaction,
            single_commit=state.single_commit,
            read=reader,
        )
        if read and answer.body is read[0].body and answer.status == read[0].status:
            original = made[0]  # the first execution: the view's own response, cookies and all
            original.headers.setdefault(REQUEST_ID_HEADER, http.request_id)
            return original
        for unsent in made:
            unsent.close()  # its file, its generator (and the context it holds) closed now
        return _to_flask(answer)

    @property
    def session(self) -> Session:
        """The request's ``Session`` (``db=``), in the transaction the completion is written
        in: Flask-SQLAlchemy's ``db.session``, or one made for the protected view."""
        found: Session | None = g.get(_SESSION)
        if found is None and self.db is not None and not _is_engine_side(self.db):
            found = self.db.session()  # type: ignore[union-attr]
        if found is None:
            raise RuntimeError("idem.session exists only while a protected view runs (db=)")
        return found

    def _open_store(self, app: Flask, policy: Policy) -> Store:
        url, table = app.config["IDEMFLOW_STORE"], app.config["IDEMFLOW_TABLE"]
        from ..stores.urls import open_store

        if url:
            return open_store(str(url), table=table, policy=policy)
        if self.db is None:
            raise ConfigurationError("set IDEMFLOW_STORE (a DATABASE_URL) or pass db= or store=")
        with app.app_context():
            engine = _engine_of(self.db)
        return engine_store(engine, table, policy)


def _session_transactions(db: _Database) -> TransactionFactory:
    """The request's transaction on ``db``: Flask-SQLAlchemy's scoped session, or a
    ``Session`` of the engine's made for the request (``idem.session``)."""
    from sqlalchemy.orm import sessionmaker

    from ..transactions import SQLAlchemyTransaction

    if not _is_engine_side(db):
        scoped = getattr(db, "session", None)
        if scoped is None:
            msg = f"db= takes Flask-SQLAlchemy's db, an Engine or a sessionmaker, not {db!r}"
            raise ConfigurationError(msg)
        # A scoped_session: called, it is the request's own Session.
        return lambda: nullcontext(SQLAlchemyTransaction(scoped()))
    sessions: sessionmaker[Any] = db if isinstance(db, sessionmaker) else sessionmaker(db)

    @contextlib.contextmanager
    def transaction() -> Iterator[Transaction]:
        with sessions() as session:
            setattr(g, _SESSION, session)
            try:
                yield SQLAlchemyTransaction(session)
            finally:
                g.pop(_SESSION, None)

    return transaction


def _is_engine_side(db: object) -> TypeGuard[Engine | sessionmaker[Any]]:
    """An engine or a sessionmaker (sessions made per request), not Flask-SQLAlchemy's."""
    from sqlalchemy.engine import Engine
    from sqlalchemy.orm import sessionmaker

    return isinstance(db, Engine | sessionmaker)


def _engine_of(db: Any) -> Engine:
    from sqlalchemy.engine import Engine
    from sqlalchemy.orm import sessionmaker

    engine = db.kw.get("bind") if isinstance(db, sessionmaker) else getattr(db, "engine", db)
    if not isinstance(engine, Engine):
        msg = f"db= takes Flask-SQLAlchemy's db, an Engine or a bound sessionmaker, not {db!r}"
        raise ConfigurationError(msg)
    return engine


def _body(limit: int) -> bytes:
    """The whole body, at most ``limit`` bytes (or ``MAX_CONTENT_LENGTH`` when lower). One
    shorter than its ``Content-Length`` is a 400: Werkzeug raises ``ClientDisconnected``
    only where it bounds the stream itself, else returns what arrived."""
    environ = request.environ
    current = request.max_content_length
    cap = limit if current is None else min(limit, current)
    # The shared rule, on the raw value: Werkzeug reads a Content-Length it cannot
    # parse (5,000 digits) as 0, an empty body that would be claimed in its place.
    declared = declared_length(environ.get("CONTENT_LENGTH"), cap)
    if request.content_length is None:  # Werkzeug ignores a length sent with chunked
        declared = None
        _require_length(environ)  # a chunked body the server does not end: 411, not empty
        # A body without its length (chunked, behind a server that terminates the
        # stream): Werkzeug reads it up to the request's maximum and returns what it
        # read, cut there, without a word. One byte past ``cap`` tells a body too large.
        request.max_content_length = cap + 1
    try:
        body = request.get_data(cache=True)
    except RequestEntityTooLarge:
        raise body_too_large(0, cap, streaming=True) from None
    except ClientDisconnected:
        raise IncompleteBody(
            "the request body ended before its Content-Length: the client went away; "
            "nothing was recorded, send the whole request again"
        ) from None
    if len(body) > cap:
        raise body_too_large(len(body), cap, streaming=True)
    if declared is not None and len(body) != declared:
        raise body_cut_short(len(body), declared)
    return body


def _from_flask(response: FlaskResponse) -> Response:
    """A Flask response with its body in memory as an idemflow Response; a streamed or
    ``send_file`` one is `ResponseNotStorable`, carrying its status and headers for the
    ``response-not-stored`` marker."""
    headers = tuple((k, v) for k, v in response.headers.items() if k.lower() != "content-length")
    if response.is_streamed or response.direct_passthrough:
        msg = (
            "the view streams its response, which cannot be stored for replay; "
            "return a body in memory from protected views"
        )
        raise ResponseNotStorable(msg, response=Response(response.status_code, b"", headers))
    return Response(response.status_code, response.get_data(), headers)


def _to_flask(response: Response) -> FlaskResponse:
    """An idemflow Response (a replay, a problem) as a Flask one, header lines as they are."""
    result = FlaskResponse(response.body, status=response.status)
    result.headers.clear()  # only the stored headers: no default text/html
    for name, value in sendable_headers(response):
        result.headers.add(name.decode("latin-1"), value.decode("latin-1"))
    return result


def handle_outcome_unknown(app: Flask) -> None:
    """Answer an ``OutcomeUnknown`` with the 503 ``outcome-unknown`` problem, reported to
    the WSGI middleware (which registers it on the app it wraps, unless the app has its own
    handler: that one calls `idemflow.integrations.wsgi.report_outcome_unknown`)."""
    report_from_flask(app)


def _cli(extension: Idempotency) -> Any:
    import click
    from flask.cli import AppGroup

    group = AppGroup("idemflow", help="idemflow's key table: migrate, sweep, purge.")

    @group.command("migrate")
    def migrate() -> None:
        """Create the key table and its indexes (safe to run again)."""
        extension._state().store.migrate()
        click.echo("migrated")

    @group.command("sweep")
    def sweep() -> None:
        """Release claims left in progress past the stale threshold."""
        from ..sweeper import Sweeper

        state = extension._state()
        report = Sweeper(
            state.store,  # type: ignore[arg-type]
            state.driver.policy,
            observer=state.driver.observer,  # its stale_reclaimed counted as its requests are
        ).sweep_once()
        click.echo(f"swept: released={report.released} unknown={report.unknown}")

    @group.command("purge")
    @click.option("--batch", default=1000, show_default=True)
    def purge(batch: int) -> None:
        """Delete records past their retention, in batches."""
        store: Any = extension._state().store
        total = 0
        while (deleted := store.purge(time.time(), batch)) > 0:
            total += deleted
        click.echo(f"purged: {total} records")

    return group


#: Issue 32: the extension's own conversions; importable from here, with a
#: DeprecationWarning, until 0.3.
__getattr__ = moved(
    __name__,
    {name: f"{__name__}:_{name}" for name in ("flask_login_user", "from_flask", "to_flask")},
)
