"""What the test asks of the quick start's project, run by its environment's python:
``python check.py PATH``; prints the answers as JSON."""

import json
import os
import sys
import uuid
from typing import Any

os.environ["DJANGO_SETTINGS_MODULE"] = "settings"

import django

django.setup()

from django.contrib.auth.models import User  # noqa: E402 (after setup)
from django.core.management import call_command  # noqa: E402
from django.test import Client  # noqa: E402
from payments.models import Payment  # type: ignore[import-not-found]  # noqa: E402

call_command("migrate", run_syncdb=True, verbosity=0)
where = sys.argv[1]
alice = Client()
alice.force_login(User.objects.create_user("alice"))


def post(body: dict[str, Any], key: str, client: Client = alice) -> list[Any]:
    answer = client.post(where, body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key)
    return [answer.status_code, answer.headers.get("Idempotent-Replayed"), answer.content.decode()]


key, fixed = f"order-{uuid.uuid4().hex}", f"order-{uuid.uuid4().hex}"
answers = {
    "first": post({"amount": 1000}, key),
    "replay": post({"amount": 1000}, key),
    "other": post({"amount": 5}, key),
    "nobody": post({"amount": 1000}, key, Client()),
    "invalid": post({"amount": 0}, fixed),
    "fixed": post({"amount": 7}, fixed),
    "rows": sorted(Payment.objects.values_list("amount", flat=True)),
}
print(json.dumps(answers))
