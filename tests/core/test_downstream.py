"""Downstream keys: the same for one intent however it is retried, distinct otherwise."""

from __future__ import annotations

import dataclasses

from idemflow import Record, State, downstream_key


def record(**changes: object) -> Record:
    base = Record(
        id=1,
        principal="alice",
        key="7f3a",
        fingerprint="sha256:aa",
        endpoint="POST /payments",
        state=State.IN_PROGRESS,
        lease_token="lease-1",
        created_at=1_800_000_000.0,
        updated_at=1_800_000_000.0,
        expires_at=1_800_086_400.0,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_the_same_intent_gets_the_same_key_however_it_is_retried() -> None:
    """A retry of a released key, a sweeper's takeover, a new lease: one key (the record
    keeps created_at, the moment the intent began, through all of them)."""
    first = downstream_key(record(), "charge")
    retried = record(
        id=9, lease_token="lease-2", updated_at=1_800_000_123.0, attempt=3, recovery_point="x"
    )

    assert downstream_key(retried, "charge") == first


def test_a_new_retention_period_is_a_new_intent_with_new_keys() -> None:
    """Past retention the same key and body start a new intent (created_at resets): the
    provider must not answer the new intent with the old charge."""
    first = downstream_key(record(), "charge")
    renewed = record(created_at=1_800_090_000.0, attempt=1)

    assert downstream_key(renewed, "charge") != first
    # Milliseconds are what stores keep: sub-millisecond noise changes nothing.
    assert downstream_key(record(created_at=1_800_000_000.0004), "charge") == first


def test_every_part_of_the_intent_changes_the_key() -> None:
    """Principal, client key, step and request fingerprint each make a new key."""
    keys = {
        downstream_key(record(), "charge"),
        downstream_key(record(), "refund"),
        downstream_key(record(principal="bob"), "charge"),
        downstream_key(record(key="7f3b"), "charge"),
        downstream_key(record(fingerprint="sha256:bb"), "charge"),
    }

    assert len(keys) == 5


def test_the_key_discloses_neither_principal_nor_client_key() -> None:
    """What the provider sees is a namespaced digest."""
    key = downstream_key(record(), "charge")

    assert key.startswith("idemflow-")
    assert "alice" not in key
    assert "7f3a" not in key
