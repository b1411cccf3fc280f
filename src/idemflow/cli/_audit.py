"""``idemflow audit URL``: arguments only; the checks (`idemflow.audit`) load when it runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ._common import positive_int, positive_seconds

EXIT_CHECK_FAILED = 1


def header(text: str) -> tuple[str, str]:
    name, colon, value = text.partition(":")
    if not colon or not name.strip():
        msg = f"expected 'Name: value', got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return name.strip(), value.strip()


def names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "audit",
        help="check an Idempotency-Key endpoint from outside, in any language",
        description=(
            "Black-box checks of one endpoint over HTTP: missing and malformed keys, replays, "
            "key reuse, concurrent duplicates, in-flight duplicates, principal isolation. "
            "Exit 1 when a check fails. See docs/audit.md."
        ),
    )
    add = parser.add_argument
    repeated: Any = {"action": "append", "type": header, "default": [], "metavar": "'NAME: VALUE'"}
    add("url", metavar="URL", help="the endpoint, e.g. http://127.0.0.1:8000/payments")
    add("--method", default="POST", help="(default: %(default)s)")
    first = "the first principal's credentials (repeatable)"
    add("--header", dest="headers", help=first, **repeated)
    other = "another principal's credentials (repeatable): enables principal-isolation"
    add("--second-principal-header", dest="second_principal_headers", help=other, **repeated)
    body = "the request body; {n} becomes a distinct integer per intent (default: %(default)s)"
    add("--body", default='{"n": {n}}', metavar="TEMPLATE", help=body)
    add("--content-type", default="application/json", help="(default: %(default)s)")
    add("--key-header", default="Idempotency-Key", help="(default: %(default)s)")
    add("--slow-body", metavar="TEMPLATE", help="a body the endpoint takes ≥ 1 s to answer")
    slow = "a header that makes the endpoint take ≥ 1 s (repeatable)"
    add("--slow-header", dest="slow_headers", help=slow, **repeated)
    counts = "a GET (on the same origin) whose answer counts executions"
    add("--count-url", metavar="URL", help=counts)
    add("--concurrency", type=positive_int, default=20, metavar="N", help="(default: 20)")
    add("--key-optional", action="store_true", help="the API accepts requests without a key")
    add("--timeout", type=positive_seconds, default=10.0, help="per request (default: 10)")
    add("--only", action="append", type=names, default=[], metavar="NAMES", help="run only these")
    add("--skip", action="append", type=names, default=[], metavar="NAMES", help="skip these")
    add("--json", action="store_true", help="print the report as JSON")
    add("--junit", type=Path, metavar="FILE", help="also write a JUnit XML report")
    add("--yes", action="store_true", help="allow a host other than loopback")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from idemflow.audit import audit, plan

    given = ("body", "content_type", "key_header", "slow_body", "count_url", "concurrency")
    options: dict[str, Any] = {
        "method": args.method.upper(),
        "headers": dict(args.headers),
        "second_principal_headers": dict(args.second_principal_headers) or None,
        "slow_headers": dict(args.slow_headers) or None,
        **{name: getattr(args, name) for name in (*given, "key_optional", "timeout")},
        "only": [name for group in args.only for name in group] or None,
        "skip": [name for group in args.skip for name in group] or None,
    }
    print(f"idemflow audit: {plan(args.url, **options)}", file=sys.stderr)
    report = audit(args.url, allow_remote=args.yes, **options)
    if args.junit:
        args.junit.write_text(report.junit())
    if args.json:
        import json

        print(json.dumps(report.as_json(), indent=2, ensure_ascii=False))
    else:
        print(report.table())
    return EXIT_CHECK_FAILED if report.failed else 0
