"""
The network-fault storm on a 3-node MariaDB Galera cluster, claimants through different nodes.

    .venv/bin/python -m bench.bench_storm_galera            # as root: the nodes run as mysql
    .venv/bin/python -m bench.bench_storm_galera --runs 2 -- --keys 60 --duration 8

Starts the cluster of ``tests/_galera.py`` (three primaries on free loopback
ports, ``wsrep_retry_autocommit = 0`` so every certification conflict reaches
the store), then runs ``idemflow storm --json --database NODE1 --database
NODE2 --database NODE3`` with the network storm's faults: one demo on each
node, sharing one provider ledger; each key's three clients go to three
different demos, so its claims race through three primaries; each partition
cuts one demo's link to its node. Prints each run's verdict figures, and the
certification failures and brute-force aborts the nodes counted meanwhile
(``wsrep_local_cert_failures``, ``wsrep_local_bf_aborts``: the conflicts the
store had to turn into the right answer), and stops the cluster by its PIDs.
Arguments after ``--`` are passed to the storm (they replace the default
faults below). A verdict, not a timing: the figures in ``docs/storm.md``
("On Galera") come from this command.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

#: The network storm of ``tests/guarantees/test_storm_network.py`` (``NETWORK_STORM``).
DEFAULT_STORM = [
    *("--keys", "100", "--retries", "3", "--duration", "15", "--kill-every", "0"),
    *("--partition-every", "3", "--partition-for", "1.5"),
    *("--network-delay-ms", "5", "--network-jitter-ms", "3", "--network-stall-rate", "0.02"),
]

FIGURES = (
    "ok",
    "violations",
    "requests",
    "responses",
    "partitions",
    "connections_reset",
    "payments",
    "charges",
    "duplicate_charges",
    "duplicate_payments",
    "different_answers",
    "unresolved",
    "without_retry_after",
    "stale_reclaimed",
    "releases",
    "elapsed",
)


def storm(urls: list[str], args: list[str], seed: int) -> dict[str, Any]:
    databases = [part for url in urls for part in ("--database", url)]
    command = [sys.executable, "-m", "idemflow", "storm", "--json", "--seed", str(seed)]
    command += [*args, *databases]
    print("$ idemflow storm " + " ".join(command[4:]), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode not in (0, 3):
        raise SystemExit(f"the storm could not run ({done.returncode}): {done.stderr[-2000:]}")
    verdict: dict[str, Any] = json.loads(done.stdout)
    return verdict


#: Galera's own counts of the conflicts its nodes resolved.
CONFLICTS = ("wsrep_local_cert_failures", "wsrep_local_bf_aborts")


def conflicts(cluster: Any) -> dict[str, int]:
    """Each counter summed over the nodes."""
    from tests._galera import status

    return {name: sum(int(status(node, name) or 0) for node in cluster.nodes) for name in CONFLICTS}


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    cut = raw.index("--") if "--" in raw else len(raw)
    own, passed = raw[:cut], raw[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="storms, one after the other")
    parser.add_argument("--seed", type=int, default=5, help="the first run's seed")
    options = parser.parse_args(own)

    from tests._galera import GaleraCluster

    started = time.monotonic()
    with GaleraCluster.start() as cluster:
        print(f"galera: 3 nodes synced in {time.monotonic() - started:.0f} s: {cluster.urls}")
        failed = 0
        for run in range(options.runs):
            before = conflicts(cluster)
            verdict = storm(cluster.urls, passed or DEFAULT_STORM, options.seed + run)
            after = conflicts(cluster)
            failed += not verdict["ok"]
            figures = {name: verdict[name] for name in FIGURES}
            figures["galera"] = {name: after[name] - before[name] for name in after}
            print(json.dumps(figures), flush=True)
            if not verdict["ok"]:
                print(json.dumps(verdict["details"]), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
