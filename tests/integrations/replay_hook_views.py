"""
A views module that holds its replay hook and its metrics too, as a Django project may:
its ``@idempotent`` views read ``settings.IDEMFLOW`` while the module is imported, and
``IDEMFLOW["authorize_replay"]`` and ``IDEMFLOW["observer"]`` name them by their paths
(test_replay_authorization).
"""

from __future__ import annotations

from typing import Any

from django.http import JsonResponse

from idemflow import Record
from idemflow._events import CountingObserver
from idemflow.integrations.django import idempotent


@idempotent
def pay(request: Any) -> JsonResponse:
    return JsonResponse({"id": 1}, status=201)


def may_replay(record: Record) -> bool:
    return True


async def may_replay_later(record: Record) -> bool:
    return True


#: What ``IDEMFLOW["observer"]`` names.
COUNTED = CountingObserver()
