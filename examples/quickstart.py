"""
A scripted tour of idemflow on embedded SQLite: one charge, a replay, a
conflicting reuse of the key, and a transient failure that really retries.

Run it with ``python examples/quickstart.py``.
"""

from __future__ import annotations

import json
import sqlite3
import tempfile
from pathlib import Path

from idemflow import Attempt, Idempotency, Intent, KeyReused, Policy, Response, fingerprint
from idemflow.stores.sqlite import SQLiteStore
from idemflow.transactions import SQLite3Transaction


def main() -> None:
    path = Path(tempfile.mkdtemp()) / "quickstart.db"
    store = SQLiteStore(path)
    store.migrate()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE payments (id INTEGER PRIMARY KEY, amount INTEGER)")
    idem = Idempotency(store, Policy(request_timeout=30))
    provider_up = [False]

    def charge(attempt: Attempt) -> Response:
        if not provider_up[0]:
            provider_up[0] = True
            return Response.json(503, {"title": "provider unavailable"})
        cursor = attempt.connection.execute("INSERT INTO payments (amount) VALUES (1000)")
        return Response.json(201, {"id": cursor.lastrowid, "amount": 1000})

    def post(body: dict[str, int], key: str = "7f3a-demo") -> None:
        raw = json.dumps(body).encode()
        digest = fingerprint("POST", "/payments", raw, content_type="application/json")
        intent = Intent("alice", key, digest, endpoint="POST /payments")
        try:
            outcome = idem.run(intent, charge, transaction=SQLite3Transaction(conn))
        except KeyReused as exc:
            print(f"  -> {exc.status} {exc.title}")
            return
        replay = " (replayed)" if outcome.replayed else ""
        print(f"  -> {outcome.response.status} {outcome.response.body.decode()}{replay}")

    print("1. first attempt: the provider is down, so the key is released")
    post({"amount": 1000})
    print("2. the retry really runs and charges")
    post({"amount": 1000})
    print("3. another retry replays the stored answer, no second charge")
    post({"amount": 1000})
    print("4. the same key for a different body is refused")
    post({"amount": 5})
    count = conn.execute("SELECT count(*) FROM payments").fetchone()[0]
    print(f"payments in the database: {count}")


if __name__ == "__main__":
    main()
