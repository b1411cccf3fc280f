"""
The payments domain: validating requests, and a payment in three atomic phases.

A payment touches two systems, our database and the provider, so it cannot be
one transaction. It is three phases instead (rocket-rides' atomic phases), each
ending in a recovery point a retry resumes from:

1. ``payment_created``: the payment row (``pending``) and the recovery point
   commit together, before the external call, so the call is never made
   without a local trace of it.
2. the provider is charged with ``attempt.downstream_key("charge")``; the
   provider de-duplicates on it, so a re-execution (after a 503 released the
   claim, or after a crash) cannot charge twice.
3. the payment is marked ``succeeded`` with the charge id, and the completion
   (the stored 201) commits in that same transaction.

Without a transaction shared with the key store (keys in Redis: see
:mod:`idemflow_demo.unshared`) each phase's rows commit before its recovery
point is written, so phase 1 may find its row already there (an earlier
attempt committed it, then lost its checkpoint): its insert leaves an
existing row alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
import unicodedata
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from idemflow import InvalidBody, Response
from idemflow.integrations.starlette import parse_json, problem

from .db import Connection
from .faults import crash_point
from .provider import ChargeRequest, FakeProvider, ProviderDeclined, ProviderUnavailable

__all__ = [
    "MAX_AMOUNT",
    "InvalidRequest",
    "PaymentIn",
    "Payments",
    "Phases",
    "RefundIn",
    "parse_payment",
    "parse_refund",
    "refund_id",
    "refund_response",
]

MAX_AMOUNT = 1_000_000_000
PAYMENT_CREATED = "payment_created"
#: Retry-After (seconds) on a transient provider failure.
PROVIDER_RETRY_AFTER = 1

# Active ISO 4217 codes: a currency the provider would refuse is a bad request.
_ISO_4217_CODES = """
    AED AFN ALL AMD ANG AOA ARS AUD AWG AZN BAM BBD BDT BGN BHD BIF BMD BND BOB BRL BSD BTN
    BWP BYN BZD CAD CDF CHF CLP CNY COP CRC CUP CVE CZK DJF DKK DOP DZD EGP ERN ETB EUR FJD FKP
    GBP GEL GHS GIP GMD GNF GTQ GYD HKD HNL HTG HUF IDR ILS INR IQD IRR ISK JMD JOD JPY KES KGS
    KHR KMF KPW KRW KWD KYD KZT LAK LBP LKR LRD LSL LYD MAD MDL MGA MKD MMK MNT MOP MRU MUR MVR
    MWK MXN MYR MZN NAD NGN NIO NOK NPR NZD OMR PAB PEN PGK PHP PKR PLN PYG QAR RON RSD RUB RWF
    SAR SBD SCR SDG SEK SGD SHP SLE SOS SRD SSP STN SVC SYP SZL THB TJS TMT TND TOP TRY TTD TWD
    TZS UAH UGX USD UYU UZS VES VND VUV WST XAF XCD XCG XOF XPF YER ZAR ZMW ZWG"""
ISO_4217 = frozenset(_ISO_4217_CODES.split())
MAX_CUSTOMER_LENGTH = 200


class InvalidRequest(ValueError):
    """The request body is not a valid request: 400, checked before any claim."""


@dataclass(frozen=True, slots=True)
class PaymentIn:
    amount: int
    currency: str
    customer: str


@dataclass(frozen=True, slots=True)
class RefundIn:
    amount: int


def _object(body: bytes, fields: set[str]) -> dict[str, Any]:
    # The fingerprint's own strict reader, whatever the Content-Type says: it
    # refuses what json.loads would let through to a 500 (a 10,000-deep body,
    # a lone surrogate the database cannot encode, duplicate members).
    try:
        data = parse_json(body)
    except InvalidBody as exc:
        raise InvalidRequest(f"the body must be a JSON object: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    unknown = sorted(set(data) - fields)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)}")
    missing = sorted(fields - set(data))
    if missing:
        raise InvalidRequest(f"missing field(s): {', '.join(missing)}")
    return data


def _amount(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_AMOUNT:
        msg = f"amount must be an integer number of minor units from 1 to {MAX_AMOUNT}"
        raise InvalidRequest(msg)
    return value


def parse_payment(body: bytes) -> PaymentIn:
    """``{"amount", "currency", "customer"}``, or InvalidRequest saying what is wrong."""
    data = _object(body, {"amount", "currency", "customer"})
    currency, customer = data["currency"], data["customer"]
    if not isinstance(currency, str) or currency not in ISO_4217:
        raise InvalidRequest("currency must be an ISO 4217 code in capitals, e.g. EUR")
    if not isinstance(customer, str) or not customer.strip():
        raise InvalidRequest("customer must be a non-empty string")
    if len(customer) > MAX_CUSTOMER_LENGTH:
        raise InvalidRequest(f"customer must be at most {MAX_CUSTOMER_LENGTH} characters")
    _printable("customer", customer)
    return PaymentIn(_amount(data["amount"]), currency, customer)


def _printable(name: str, text: str) -> None:
    """Refuse control characters (NUL: PostgreSQL cannot store it) and surrogates."""
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cs"):
            msg = f"{name} must not contain control characters (found U+{ord(ch):04X})"
            raise InvalidRequest(msg)


def parse_refund(body: bytes) -> RefundIn:
    """``{"amount"}``, or InvalidRequest."""
    return RefundIn(_amount(_object(body, {"amount"})["amount"]))


class Phases(Protocol):
    """What a payment needs of its attempt (an :class:`idemflow.AsyncAttempt`, or a plain one)."""

    @property
    def connection(self) -> Any: ...
    @property
    def recovery_point(self) -> str | None: ...
    def downstream_key(self, step: str) -> str: ...
    async def commit_phase(self, recovery_point: str) -> None: ...


def payment_json(row: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("id", "amount", "currency", "customer", "status", "charge_id")
    return {key: row[key] for key in keys}


def succeeded_response(row: Mapping[str, Any]) -> Response:
    """The 201 a charged payment answers (and the sweeper's reconciler stores)."""
    location = f"/payments/{row['id']}"
    return Response.json(201, payment_json(row), [("location", location)])


def declined_response(payment_id: str, declined: ProviderDeclined) -> Response:
    """The 402 a declined payment answers (stored as failed_permanent)."""
    return problem(
        402,
        "Payment declined",
        str(declined),
        slug="payment-declined",
        payment_id=payment_id,
        charge_id=declined.charge.id,
    )


def refund_id(downstream_key: str) -> str:
    """A refund's id, from its attempt's downstream key: the same for every retry.

    So a refund can be looked up by the key it was made under (the
    reconciler's question when its completion was lost), and one made twice
    would collide on the primary key instead of refunding again.
    """
    return "re_" + hashlib.sha256(downstream_key.encode()).hexdigest()[:20]


def refund_response(row: Mapping[str, Any]) -> Response:
    """The 201 a refund answers (and the sweeper's reconciler stores)."""
    body = {
        "id": row["id"],
        "payment_id": row["payment_id"],
        "amount": row["amount"],
        "status": "succeeded",
    }
    return Response.json(201, body)


_INSERT_PENDING = (
    "INSERT INTO payments (id, intent_ref, principal, amount, currency, customer, "
    "status, created_at) VALUES (:id, :intent_ref, :principal, :amount, :currency, "
    ":customer, :status, :created_at)"
)
#: SQLite and PostgreSQL: the row of an earlier attempt (same intent) is left as it is.
_INSERT_PENDING_ONCE = _INSERT_PENDING + " ON CONFLICT (intent_ref) DO NOTHING"

_PAYMENT_COLUMNS = "id, principal, amount, currency, customer, status, charge_id, refunded"
#: What the read endpoints show: payments whose intent settled (never ``pending``).
_SETTLED = "status <> 'pending'"


class Payments:
    """The payment and refund operations, on connections the caller hands in.

    Args:
        provider: the external provider.
        wrap: turns a raw driver connection into a :class:`Connection`.
        connect: a pooled raw connection, for reads outside a transaction.
        provider_timeout: the longest a provider call may take (a timeout is
            a transient failure: the claim is released).
        transactional: the key store shares the payments' transaction; when
            it does not, phase 1 may meet its own row from an earlier attempt.
    """

    def __init__(
        self,
        provider: FakeProvider,
        wrap: Callable[[Any], Connection],
        connect: Callable[[], Any],
        provider_timeout: timedelta,
        *,
        transactional: bool = True,
    ) -> None:
        self.provider = provider
        self._insert = _INSERT_PENDING if transactional else _INSERT_PENDING_ONCE
        self._wrap = wrap
        self._connect = connect
        self._timeout = provider_timeout.total_seconds()

    async def create(self, attempt: Phases, principal: str, payment: PaymentIn) -> Response:
        """Charge once; 201, or 402 (declined, stored), or 503 (transient, released).

        Everything runs on ``attempt.connection``: a protected request holds at
        most one pooled connection at any moment (a second checkout while the
        attempt's transaction holds one deadlocks a small pool shared with the
        store).
        """
        conn = self._wrap(attempt.connection)
        intent_ref = attempt.downstream_key("payment")
        if attempt.recovery_point is None:
            await self._insert_pending(conn, intent_ref, principal, payment)
            await attempt.commit_phase(PAYMENT_CREATED)
        # A retry after a transient failure or a crash (recovery point set) finds
        # the pending row under the same intent_ref, and charges with what the
        # request says: the fingerprint proves it is the body that row was made
        # from. Nothing is read before the call, so on SQLite no snapshot is
        # pinned that the phase-3 write would have to upgrade from.
        request = ChargeRequest(
            attempt.downstream_key("charge"),
            payment.amount,
            payment.currency,
            payment.customer,
            principal,
        )
        try:
            async with asyncio.timeout(self._timeout):
                charge = await self.provider.charge(request)
        except (ProviderUnavailable, TimeoutError) as exc:
            detail = str(exc) or "the payment provider did not answer in time"
            return problem(
                503,
                "Payment provider unavailable",
                detail,
                slug="provider-unavailable",
                retry_after=PROVIDER_RETRY_AFTER,
            )
        except ProviderDeclined as declined:
            crash_point("after_charge")  # TEST-ONLY: off unless IDEMFLOW_DEMO_CRASH_AT is set
            row = await self._settle(conn, intent_ref, "declined", declined.charge.id)
            return declined_response(row["id"], declined)
        crash_point("after_charge")  # TEST-ONLY: off unless IDEMFLOW_DEMO_CRASH_AT is set
        return succeeded_response(await self._settle(conn, intent_ref, "succeeded", charge.id))

    async def _insert_pending(
        self, conn: Connection, intent_ref: str, principal: str, payment: PaymentIn
    ) -> None:
        row = {
            "id": "pay_" + secrets.token_hex(10),
            "intent_ref": intent_ref,
            "principal": principal,
            "amount": payment.amount,
            "currency": payment.currency,
            "customer": payment.customer,
            "status": "pending",
            "created_at": time.time(),
        }
        await conn.execute(self._insert, row)

    async def _settle(
        self, conn: Connection, intent_ref: str, status: str, charge_id: str
    ) -> dict[str, Any]:
        # Write first, then read, on the attempt's connection: on SQLite the
        # write takes the lock at the newest snapshot, and the read sees it.
        changed = await conn.execute(
            "UPDATE payments SET status = :status, charge_id = :charge_id WHERE intent_ref = :ref",
            {"status": status, "charge_id": charge_id, "ref": intent_ref},
        )
        row = await conn.fetchone(
            f"SELECT {_PAYMENT_COLUMNS} FROM payments WHERE intent_ref = :ref", {"ref": intent_ref}
        )
        if changed != 1 or row is None:
            raise RuntimeError("recovery point payment_created without a payment row")
        return row

    async def refund(
        self, attempt: Phases, principal: str, payment_id: str, refund: RefundIn
    ) -> Response:
        """Refund part of a succeeded payment: one local transaction, completion included."""
        conn = self._wrap(attempt.connection)
        # Write first (SQLite: take the write lock before reading anything).
        changed = await conn.execute(
            "UPDATE payments SET refunded = refunded + :amount WHERE id = :id "
            "AND principal = :principal AND status = 'succeeded' "
            "AND refunded + :amount <= amount",
            {"amount": refund.amount, "id": payment_id, "principal": principal},
        )
        if changed != 1:
            return problem(
                400,
                "Refund not possible",
                "the payment is not succeeded, or the refund exceeds what is left",
                slug="refund-not-possible",
            )
        row = {
            "id": refund_id(attempt.downstream_key("refund")),
            "payment_id": payment_id,
            "principal": principal,
            "amount": refund.amount,
            "now": time.time(),
        }
        await conn.execute(
            "INSERT INTO refunds (id, payment_id, principal, amount, created_at) "
            "VALUES (:id, :payment_id, :principal, :amount, :now)",
            row,
        )
        return refund_response(row)

    async def get(self, principal: str, payment_id: str) -> dict[str, Any] | None:
        """One of ``principal``'s settled payments (a pending one is not shown: see list)."""
        async with self._connect() as raw:
            return await self._wrap(raw).fetchone(
                f"SELECT {_PAYMENT_COLUMNS} FROM payments WHERE id = :id AND principal = :p "
                f"AND {_SETTLED}",
                {"id": payment_id, "p": principal},
            )

    async def list(self, principal: str, limit: int = 100) -> list[dict[str, Any]]:
        """``principal``'s settled payments, newest first.

        A pending row is an intent whose outcome is not known yet: the client
        was told 503 (or never got an answer), so it is not shown. It settles
        on a retry, or the sweeper's reconciler settles or deletes it.
        """
        async with self._connect() as raw:
            return await self._wrap(raw).fetchall(
                f"SELECT {_PAYMENT_COLUMNS} FROM payments WHERE principal = :p AND {_SETTLED} "
                "ORDER BY created_at DESC LIMIT :limit",
                {"p": principal, "limit": limit},
            )


Operation = Callable[[Phases], Awaitable[Response]]
