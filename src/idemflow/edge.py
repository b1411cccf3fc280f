"""The HTTP edge a framework integration is built from (docs/architecture.md, "Adding a
framework"): the framework's request as an [`HTTPRequest`][idemflow.edge.HTTPRequest], through
[`AsyncEdge.respond`][idemflow.edge.AsyncEdge.respond] or `Edge.respond`, back from a
[`Response`][idemflow.Response]. The helpers idemflow's integrations share are here too,
outside ``__all__``."""

from ._async.edge import AsyncEdge, AsyncPooledTransaction
from ._async.edge import pooled_transaction as async_pooled_transaction
from ._engine import async_engine_store, engine_store
from ._flow import async_resolve
from ._http import (
    DEFAULT_MAX_RESPONSE_BYTES,
    KEY_HEADER,
    ORIGINAL_REQUEST_ID_HEADER,
    OUTCOME_SLOT,
    PROBLEM_CONTENT_TYPE,
    REPLAYED_HEADER,
    REQUEST_ID_HEADER,
    SAFE_METHODS,
    BodyReader,
    EdgeOptions,
    Endpoint,
    Endpoints,
    HTTPRequest,
    OutcomeSlot,
    RawHeaders,
    ResponseSink,
    RoutePolicy,
    ViewEdges,
    body_cut_short,
    body_too_large,
    compile_endpoint,
    declared_length,
    header_values,
    not_stored,
    plain_callable,
    policy_for,
    problem,
    problem_for,
    raw_headers,
    report_outcome_unknown,
    request_id_from,
    route_table,
    sendable_headers,
    settled_verdict,
    sync_replay_authorizer,
)
from ._identity import DEFAULT_MAX_BODY_BYTES, parse_json
from ._sync.edge import Edge, PooledTransaction, pooled_transaction

__all__ = [
    "AsyncEdge",
    "BodyReader",
    "Edge",
    "EdgeOptions",
    "HTTPRequest",
    "async_pooled_transaction",
    "pooled_transaction",
    "problem",
    "problem_for",
    "report_outcome_unknown",
    "request_id_from",
    "sendable_headers",
]
