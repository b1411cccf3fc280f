"""
The HTTP edge: what a framework integration is built from.

Every module in :mod:`idemflow.integrations` imports the edge from here, and a
new framework's integration does the same (``docs/architecture.md``, "Adding a
framework"): translate the framework's request into an :class:`HTTPRequest`
(its body read whole with the body rules below), call :meth:`AsyncEdge.respond`
(ASGI) or :meth:`Edge.respond` (WSGI) with the handler and a transaction scope,
and turn the returned :class:`~idemflow.Response` back into the framework's.
The drivers, the model and the errors are :mod:`idemflow`'s own public names.

``tests/core/test_layers.py`` checks that no integration reaches past this module
into ``idemflow._http``, ``idemflow._sync`` or ``idemflow._async``.
"""

from ._async.edge import AsyncEdge, AsyncPooledTransaction
from ._async.edge import pooled_transaction as async_pooled_transaction
from ._canonical import parse_json
from ._concurrency import async_resolve
from ._fingerprint import DEFAULT_MAX_BODY_BYTES
from ._http import (
    DEFAULT_MAX_RESPONSE_BYTES,
    KEY_HEADER,
    ORIGINAL_REQUEST_ID_HEADER,
    OUTCOME_SLOT,
    PROBLEM_CONTENT_TYPE,
    REPLAYED_HEADER,
    REQUEST_ID_HEADER,
    SAFE_METHODS,
    EdgeOptions,
    HTTPRequest,
    OutcomeSlot,
    RawHeaders,
    body_cut_short,
    body_too_large,
    declared_length,
    header_values,
    not_stored,
    plain_callable,
    problem,
    problem_for,
    report_outcome_unknown,
    request_id_from,
    sendable_headers,
    settled_verdict,
    sync_replay_authorizer,
)
from ._sync.edge import Edge, PooledTransaction, pooled_transaction

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "KEY_HEADER",
    "ORIGINAL_REQUEST_ID_HEADER",
    "OUTCOME_SLOT",
    "PROBLEM_CONTENT_TYPE",
    "REPLAYED_HEADER",
    "REQUEST_ID_HEADER",
    "SAFE_METHODS",
    "AsyncEdge",
    "AsyncPooledTransaction",
    "Edge",
    "EdgeOptions",
    "HTTPRequest",
    "OutcomeSlot",
    "PooledTransaction",
    "RawHeaders",
    "async_pooled_transaction",
    "async_resolve",
    "body_cut_short",
    "body_too_large",
    "declared_length",
    "header_values",
    "not_stored",
    "parse_json",
    "plain_callable",
    "pooled_transaction",
    "problem",
    "problem_for",
    "report_outcome_unknown",
    "request_id_from",
    "sendable_headers",
    "settled_verdict",
    "sync_replay_authorizer",
]
