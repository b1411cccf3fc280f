"""
The HTTP edge: what a framework integration is built from.

A new framework's integration (``docs/architecture.md``, "Adding a framework")
translates the framework's request into an :class:`HTTPRequest` (its body read
whole and bounded), calls :meth:`AsyncEdge.respond` (ASGI) or
:meth:`Edge.respond` (WSGI) with the handler and a transaction scope, and turns
the returned :class:`~idemflow.Response` back into the framework's.
``tests/test_layers.py`` checks that no integration reaches past this module
into ``idemflow._http``, ``idemflow._sync`` or ``idemflow._async``; the helpers
idemflow's own integrations share are importable here (``name as name``) but not
part of ``__all__``.
"""

from ._async.edge import AsyncEdge
from ._async.edge import AsyncPooledTransaction as AsyncPooledTransaction
from ._async.edge import pooled_transaction as async_pooled_transaction
from ._canonical import parse_json as parse_json
from ._concurrency import async_resolve as async_resolve
from ._fingerprint import DEFAULT_MAX_BODY_BYTES
from ._http import (
    DEFAULT_MAX_RESPONSE_BYTES,
    KEY_HEADER,
    REPLAYED_HEADER,
    REQUEST_ID_HEADER,
    EdgeOptions,
    HTTPRequest,
    problem,
    problem_for,
    report_outcome_unknown,
)
from ._http import (
    ORIGINAL_REQUEST_ID_HEADER as ORIGINAL_REQUEST_ID_HEADER,
)
from ._http import (
    OUTCOME_SLOT as OUTCOME_SLOT,
)
from ._http import (
    PROBLEM_CONTENT_TYPE as PROBLEM_CONTENT_TYPE,
)
from ._http import (
    SAFE_METHODS as SAFE_METHODS,
)
from ._http import (
    BodyReader as BodyReader,
)
from ._http import (
    Endpoint as Endpoint,
)
from ._http import (
    OutcomeSlot as OutcomeSlot,
)
from ._http import (
    RawHeaders as RawHeaders,
)
from ._http import (
    ResponseSink as ResponseSink,
)
from ._http import (
    body_cut_short as body_cut_short,
)
from ._http import (
    body_too_large as body_too_large,
)
from ._http import (
    compile_endpoint as compile_endpoint,
)
from ._http import (
    declared_length as declared_length,
)
from ._http import (
    header_values as header_values,
)
from ._http import (
    not_stored as not_stored,
)
from ._http import (
    plain_callable as plain_callable,
)
from ._http import (
    request_id_from as request_id_from,
)
from ._http import (
    sendable_headers as sendable_headers,
)
from ._http import (
    settled_verdict as settled_verdict,
)
from ._http import (
    sync_replay_authorizer as sync_replay_authorizer,
)
from ._sync.edge import Edge, pooled_transaction
from ._sync.edge import PooledTransaction as PooledTransaction

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "KEY_HEADER",
    "REPLAYED_HEADER",
    "REQUEST_ID_HEADER",
    "AsyncEdge",
    "Edge",
    "EdgeOptions",
    "HTTPRequest",
    "async_pooled_transaction",
    "pooled_transaction",
    "problem",
    "problem_for",
    "report_outcome_unknown",
]
