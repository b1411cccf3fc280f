"""Lease tokens are unique across claims, threads and forked processes."""

from __future__ import annotations

import os
import threading

from idemflow._model import new_lease_token


def test_tokens_are_unique_across_threads() -> None:
    """Concurrent claims never share a token."""
    seen: list[str] = []

    def take() -> None:
        seen.extend(new_lease_token() for _ in range(2000))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(set(seen)) == len(seen) == 16000


def test_a_forked_child_draws_a_new_prefix() -> None:
    """Parent and child after fork() must not continue the same sequence."""
    read, write = os.pipe()
    parent_token = new_lease_token()
    pid = os.fork()
    if pid == 0:  # child: report its next token and leave at once
        os.write(write, new_lease_token().encode())
        os._exit(0)
    os.close(write)
    child_token = os.read(read, 200).decode()
    os.waitpid(pid, 0)
    os.close(read)

    assert child_token[:24] != parent_token[:24]
    assert child_token != new_lease_token()
