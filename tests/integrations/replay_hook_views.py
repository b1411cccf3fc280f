"""
A views module that holds its replay hook too, as a Django project may: its
``@idempotent`` views read ``settings.IDEMFLOW`` while the module is imported, and
``IDEMFLOW["authorize_replay"]`` names the hook by its path (test_replay_authorization).
"""

from __future__ import annotations

from typing import Any

from django.http import JsonResponse

from idemflow import Record
from idemflow.integrations.django import idempotent


@idempotent
def pay(request: Any) -> JsonResponse:
    return JsonResponse({"id": 1}, status=201)


def may_replay(record: Record) -> bool:
    return True


async def may_replay_later(record: Record) -> bool:
    return True
