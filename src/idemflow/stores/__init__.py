"""Key stores, one package per backend, imported by path (one never pulls in another's driver).

[`sqlite`][idemflow.stores.sqlite], [`postgres`][idemflow.stores.postgres],
[`mysql`][idemflow.stores.mysql], [`redis`][idemflow.stores.redis],
[`django`][idemflow.stores.django] and `memory` (tests); `idemflow.stores.protocol` is the contract.
"""

from .memory import AsyncMemoryStore, MemoryStore
from .protocol import AsyncStore, AsyncTransaction, Store, Transaction

__all__ = [
    "AsyncMemoryStore",
    "AsyncStore",
    "AsyncTransaction",
    "MemoryStore",
    "Store",
    "Transaction",
]
