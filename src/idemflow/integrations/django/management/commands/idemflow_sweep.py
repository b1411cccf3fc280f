"""``manage.py idemflow_sweep``: resolve stale claims of the configured store."""

from __future__ import annotations

from typing import Any, cast

from django.core.management.base import BaseCommand, CommandParser

from idemflow.integrations.django.conf import get_store, idemflow_settings, observer_of
from idemflow.stores.protocol import MaintainableStore
from idemflow.sweeper import Sweeper


class Command(BaseCommand):
    help = (
        "Mark claims left in_progress past the stale threshold (derived from "
        "IDEMFLOW['request_timeout']) as stale and release them, once or --every SECONDS. "
        "Run it from cron or as a process of its own; several at once are safe."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--every", type=float, default=None, metavar="SECONDS")
        parser.add_argument("--batch", type=int, default=100, metavar="N")

    def handle(self, *args: Any, **options: Any) -> None:
        chosen = idemflow_settings()
        sweeper = Sweeper(
            cast(MaintainableStore, get_store()),  # every SQL store, the Django one included
            chosen.policy,
            batch_size=options["batch"],
            observer=observer_of(chosen),  # IDEMFLOW['observer']: stale_reclaimed counted too
        )
        if options["every"] is not None:
            sweeper.run_forever(options["every"])
            return
        report = sweeper.sweep_once()
        self.stdout.write(
            f"swept: released={report.released} completed={report.completed} "
            f"unknown={report.unknown} lost={report.lost} batches={report.batches}"
        )
