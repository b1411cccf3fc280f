"""``manage.py idemflow_purge``: delete records past their retention, in bounded batches."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from idemflow.integrations.django.conf import get_store


class Command(BaseCommand):
    help = (
        "Delete settled and released key records whose retention has passed, "
        "--batch records per statement (never a claim in flight or being recovered)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch", type=int, default=1000, metavar="N")

    def handle(self, *args: Any, **options: Any) -> None:
        store: Any = get_store()
        batch, purged, batches = options["batch"], 0, 0
        while True:
            deleted = store.purge(time.time(), batch)
            purged, batches = purged + deleted, batches + 1
            if deleted < batch:
                break
        self.stdout.write(f"purged: {purged} records in {batches} batches")
