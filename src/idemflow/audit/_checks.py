"""The checks, the run they share, and the report, on asyncio and ``httpx.AsyncClient``.
Every request has a timeout, every check a time bound, every loop a count."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import json
import re
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar
from urllib.parse import urljoin, urlsplit
from xml.etree import ElementTree

from .._errors import ConfigurationError
from .._extras import optional

with optional("idemflow.audit"):
    import httpx


Result = Literal["pass", "fail", "skip", "info"]
T = TypeVar("T")

TRANSIENT = frozenset({408, 429, 502, 503, 504})  # retried with the same key, never stored
CHECK_SECONDS = 120.0
SLOW_SECONDS = 60.0
#: Long enough to claim, short against the slow request's ≥ 1 s; the longer for a busy server.
HEAD_STARTS = (0.2, 0.4)
IN_PROCESS = "http://audit.invalid"
#: Malformed ``Idempotency-Key`` values (RFC 8941 sf-string or token rules): each a 400.
MALFORMED_KEYS = {
    "empty": "",
    "over-long": "k" * 1024,
    "list": "a,b",
    "parameters": "k;p=1",
    "bad escape": '"a\\x"',
}


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict: ``pass``, ``fail``, ``skip`` or ``info``, and what was seen."""

    name: str
    result: Result
    detail: str


@dataclass
class Report:
    """Every check run against ``target``, in the order of `CHECKS`."""

    target: str
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def failed(self) -> list[CheckResult]:
        return [check for check in self.checks if check.result == "fail"]

    @property
    def summary(self) -> dict[str, int]:
        return {result: sum(c.result == result for c in self.checks) for result in _COUNTED}

    def as_json(self) -> dict[str, Any]:
        checks = [{"name": c.name, "result": c.result, "detail": c.detail} for c in self.checks]
        return {"target": self.target, "checks": checks, "summary": self.summary}

    def table(self) -> str:
        width = max((len(c.name) for c in self.checks), default=0)
        lines = [f"{c.name:<{width}}  {c.result:<4}  {c.detail}" for c in self.checks]
        counts = ", ".join(f"{n} {result}" for result, n in self.summary.items())
        return "\n".join([*lines, f"{self.target}: {counts}"])

    def junit(self) -> str:
        tests, failures, skipped = len(self.checks), self.summary["fail"], self.summary["skip"]
        counts = {"tests": str(tests), "failures": str(failures), "skipped": str(skipped)}
        suite = ElementTree.Element("testsuite", {"name": "idemflow audit", **counts})
        for check in self.checks:
            case = ElementTree.SubElement(suite, "testcase", classname=self.target, name=check.name)
            if check.result == "fail":
                ElementTree.SubElement(case, "failure", message=check.detail)
            elif check.result == "skip":
                ElementTree.SubElement(case, "skipped", message=check.detail)
            else:
                ElementTree.SubElement(case, "system-out").text = f"{check.result}: {check.detail}"
        return ElementTree.tostring(suite, encoding="unicode", xml_declaration=True)


_COUNTED: tuple[Result, ...] = ("pass", "fail", "skip")


@dataclass(frozen=True)
class Endpoint:
    """What the checks send, and where (the arguments of `audit`)."""

    url: str
    method: str = "POST"
    headers: Mapping[str, str] = field(default_factory=dict)
    second_principal_headers: Mapping[str, str] | None = None
    body: str = '{"n": {n}}'
    content_type: str = "application/json"
    key_header: str = "Idempotency-Key"
    slow_body: str | None = None
    slow_headers: Mapping[str, str] | None = None
    count_url: str | None = None
    concurrency: int = 20
    key_optional: bool = False
    timeout: float = 10.0

    @property
    def has_slow_request(self) -> bool:
        return self.slow_body is not None or bool(self.slow_headers)


class Run:
    """The client, a source of distinct ``n`` and keys, and what earlier checks saw."""

    def __init__(self, endpoint: Endpoint, client: httpx.AsyncClient) -> None:
        self.endpoint = endpoint
        self.client = client
        self._n = itertools.count(1)
        self.errors: list[httpx.Response] = []
        self._settled: tuple[httpx.Response, httpx.Response, int | None] | None = None

    def new_n(self) -> int:
        return next(self._n)

    @staticmethod
    def new_key() -> str:
        return f"audit-{uuid.uuid4().hex}"

    def body(self, n: int, *, slow: bool = False) -> bytes:
        template = self.endpoint.slow_body if slow and self.endpoint.slow_body else None
        return (template or self.endpoint.body).replace("{n}", str(n)).encode()

    async def send(
        self,
        key: str | None,
        n: int,
        *,
        principal: int = 1,
        slow: bool = False,
        content: bytes | None = None,
    ) -> httpx.Response:
        """One request: ``n``'s body (or ``content``) under ``key`` (None: no key header)."""
        endpoint = self.endpoint
        credentials = endpoint.headers if principal == 1 else endpoint.second_principal_headers
        headers = [("Content-Type", endpoint.content_type), *(credentials or {}).items()]
        if slow:
            headers += (endpoint.slow_headers or {}).items()
        if key is not None:
            headers.append((endpoint.key_header, key))
        body = self.body(n, slow=slow) if content is None else content
        timeout = SLOW_SECONDS if slow else endpoint.timeout
        response = await self.client.request(
            endpoint.method, endpoint.url, headers=headers, content=body, timeout=timeout
        )
        if response.status_code >= 400:
            self.errors.append(response)
        return response

    async def execute(self, key: str, n: int, *, principal: int = 1) -> list[httpx.Response]:
        """A first request, retried at most twice after a transient answer: every answer."""
        answers = [await self.send(key, n, principal=principal)]
        while answers[-1].status_code in TRANSIENT and len(answers) < 3:
            await asyncio.sleep(min(_retry_after(answers[-1]) or 0.1, 1.0))  # client backoff
            answers.append(await self.send(key, n, principal=principal))
        return answers

    async def count(self) -> int | None:
        endpoint = self.endpoint
        if endpoint.count_url is None:
            return None
        headers, timeout = dict(endpoint.headers), endpoint.timeout
        response = await self.client.get(endpoint.count_url, headers=headers, timeout=timeout)
        if response.status_code != 200:
            msg = f"the count URL answered {response.status_code}"
            raise AuditError(msg)
        return _count_in(response)

    async def counting(self, step: Awaitable[T]) -> tuple[T, int | None]:
        """``step``'s result, and how many executions it caused (None: not counted)."""
        before = await self.count()
        result = await step
        after = await self.count()
        return result, None if before is None or after is None else after - before

    async def settled(self) -> tuple[httpx.Response, httpx.Response, int | None]:
        """A request, its duplicate, and the duplicate's executions (shared by replay checks)."""
        if self._settled is None:
            key, n = self.new_key(), self.new_n()
            first = (await self.execute(key, n))[-1]
            replay, ran = await self.counting(self.send(key, n))
            self._settled = (first, replay, ran)
        return self._settled


class AuditError(Exception):
    """The audit itself cannot go on (a count URL that does not count)."""


def _ok(response: httpx.Response) -> bool:
    return 200 <= response.status_code < 300


def _retry_after(response: httpx.Response) -> int | None:
    value = response.headers.get("retry-after", "").strip()
    return int(value) if value.isdigit() else None


def _replay_marker(response: httpx.Response) -> str | None:
    """A header saying "this is a replay" (``Idempotent-Replayed: true`` and its kin)."""
    for name, value in response.headers.items():
        if "replay" in name.lower() and value.strip().lower() not in ("false", "0", "?0"):
            return f"{name}: {value}"
    return None


def _value(body: bytes) -> str:
    """A body as the JSON value it is (member order and whitespace aside), else its bytes."""
    try:
        return json.dumps(json.loads(body), sort_keys=True)
    except ValueError:
        return body.decode("latin-1")


def _count_in(response: httpx.Response) -> int:
    """A JSON number (or an object's one member), a list's length, else the text's integer."""
    try:
        value: Any = response.json()
    except ValueError:
        value = None
    for _ in range(8):
        if isinstance(value, dict) and len(value) == 1:
            value = next(iter(value.values()))
        elif isinstance(value, list):
            return len(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
        else:
            break
    match = re.search(r"-?\d+", response.text)
    if match is None:
        msg = "no count in the count URL's answer"
        raise AuditError(msg)
    return int(match.group())


def _statuses(responses: Sequence[httpx.Response]) -> str:
    counts = sorted(Counter(response.status_code for response in responses).items())
    return ", ".join(f"{s}" if n == 1 else f"{s} ×{n}" for s, n in counts)


def _counted(ran: int | None) -> str:
    return "" if ran is None else f"; the count went up by {ran}"


Verdict = tuple[Result, str]
CheckFunction = Callable[[Run], Awaitable[Verdict]]


@dataclass(frozen=True)
class Check:
    name: str
    run: CheckFunction
    #: At most how many requests it sends (count URL reads aside).
    requests: Callable[[Endpoint], int]


_REGISTRY: list[Check] = []


def check(name: str, requests: Callable[[Endpoint], int]) -> Callable[[CheckFunction], Check]:
    def register(function: CheckFunction) -> Check:
        found = Check(name, function, requests)
        _REGISTRY.append(found)
        return found

    return register


@check("missing-key-400", lambda _: 1)
async def missing_key(run: Run) -> Verdict:
    if run.endpoint.key_optional:
        return "skip", "--key-optional: the API accepts requests without a key"
    response = await run.send(None, run.new_n())
    verdict: Result = "pass" if response.status_code == 400 else "fail"
    return verdict, f"without {run.endpoint.key_header}: {response.status_code}"


@check("malformed-key-400", lambda _: len(MALFORMED_KEYS))
async def malformed_key(run: Run) -> Verdict:
    answers = {what: await run.send(key, run.new_n()) for what, key in MALFORMED_KEYS.items()}
    wrong = [f"{what}: {r.status_code}" for what, r in answers.items() if r.status_code != 400]
    if wrong:
        return "fail", "not refused with 400: " + ", ".join(wrong)
    return "pass", f"400 for each of: {', '.join(answers)}"


@check("first-request-succeeds", lambda _: 3)
async def first_request(run: Run) -> Verdict:
    answers = await run.execute(run.new_key(), run.new_n())
    seen = " then ".join(str(r.status_code) for r in answers)
    if _ok(answers[-1]):
        retried = " (retried with the same key after a transient answer)" if answers[1:] else ""
        return "pass", f"{seen}{retried}"
    if len(answers) > 1 and answers[-1].status_code == answers[0].status_code:
        return "fail", (
            f"{seen}: the transient answer came back for every retry with the same key; "
            "a transient failure must release the key, not be stored and replayed"
        )
    return "fail", f"a new request answered {seen}, not 2xx"


@check("replay-same-status-and-body", lambda _: 4)
async def replay_same(run: Run) -> Verdict:
    first, replay, ran = await run.settled()
    if not _ok(first):
        return "skip", "no first request succeeded (see first-request-succeeds)"
    if replay.status_code == 409:
        return "skip", "the duplicate was refused with 409 (see completed-not-409)"
    wrong = []
    if replay.status_code != first.status_code:
        wrong.append(f"status {replay.status_code}, first {first.status_code}")
    if replay.content != first.content:
        wrong.append(f"body differs ({len(replay.content)} bytes, first {len(first.content)})")
    for name in ("location", "content-type"):
        if name in first.headers and replay.headers.get(name) != first.headers[name]:
            wrong.append(f"{name}: {replay.headers.get(name)!r}, first {first.headers[name]!r}")
    if ran:
        wrong.append(f"the replay ran again (count +{ran})")
    if wrong:
        return "fail", "replay differs: " + "; ".join(wrong)
    kept = [name for name in ("location", "content-type") if name in first.headers]
    return "pass", (
        f"{replay.status_code}, {len(replay.content)} identical bytes"
        + (f", same {' and '.join(kept)}" if kept else "")
        + _counted(ran)
    )


@check("replay-marked", lambda _: 4)
async def replay_marked(run: Run) -> Verdict:
    first, replay, _ = await run.settled()
    if not (_ok(first) and _ok(replay)):
        return "skip", "no successful replay to look at"
    marker = _replay_marker(replay)
    if marker is None:
        return "info", "no replay header: a client cannot tell a replay from a first execution"
    return "info", f"replays are marked ({marker})"


@check("key-reuse-other-body-422", lambda _: 4)
async def key_reuse(run: Run) -> Verdict:
    key = run.new_key()
    first = (await run.execute(key, run.new_n()))[-1]
    if not _ok(first):
        return "skip", "no first request succeeded (see first-request-succeeds)"
    other = await run.send(key, run.new_n())
    if other.status_code == 422:
        return "pass", "another body under a used key: 422"
    same = (
        " with the first request's answer" if _value(other.content) == _value(first.content) else ""
    )
    return "fail", f"another body under a used key: {other.status_code}{same}, not 422"


async def _at_once(run: Run, key: str, bodies: Sequence[int]) -> list[httpx.Response]:
    """One request per body under ``key``, all at once, every one awaited."""
    answers = await asyncio.gather(*(run.send(key, n) for n in bodies), return_exceptions=True)
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
    return [answer for answer in answers if isinstance(answer, httpx.Response)]


def _judge_race(
    responses: Sequence[httpx.Response], ran: int | None, allowed: frozenset[int]
) -> Verdict:
    successes = [r for r in responses if _ok(r)]
    bodies = {_value(r.content) for r in successes}
    marked = [r for r in successes if _replay_marker(r)]
    unexpected = {r.status_code for r in responses if not _ok(r)} - allowed
    wrong = [f"answered {status}" for status in sorted(unexpected)]
    if not successes:
        wrong.append("none succeeded")
    if len(bodies) > 1:
        wrong.append(f"{len(bodies)} different successful answers: it ran more than once")
    if ran is not None and ran != 1:
        wrong.append(f"the count went up by {ran}, not 1")
    if ran is None and marked and len(successes) - len(marked) > 1:
        wrong.append(f"{len(successes) - len(marked)} successes not marked as replays")
    seen = f"{len(responses)} at once: {_statuses(responses)}"
    if marked:
        seen += f" ({len(marked)} marked replays)"
    seen += _counted(ran)
    return ("fail", f"{seen}: " + "; ".join(wrong)) if wrong else ("pass", seen)


@check("concurrent-duplicates-one-execution", lambda e: e.concurrency)
async def concurrent_duplicates(run: Run) -> Verdict:
    key, n = run.new_key(), run.new_n()
    responses, ran = await run.counting(_at_once(run, key, [n] * run.endpoint.concurrency))
    return _judge_race(responses, ran, frozenset({409}))


@check("concurrent-other-bodies-one-success", lambda e: e.concurrency)
async def concurrent_other_bodies(run: Run) -> Verdict:
    bodies = [run.new_n() for _ in range(run.endpoint.concurrency)]
    responses, ran = await run.counting(_at_once(run, run.new_key(), bodies))
    return _judge_race(responses, ran, frozenset({409, 422}))


@check("in-flight-409-retry-after", lambda e: 2 * len(HEAD_STARTS) if e.has_slow_request else 0)
async def in_flight(run: Run) -> Verdict:
    if not run.endpoint.has_slow_request:
        return "skip", "no slow request (--slow-body or --slow-header)"
    for head_start in HEAD_STARTS:
        verdict = await _overlap(run, head_start)
        if verdict is not None:
            return verdict
    return "fail", f"the duplicate overtook the first request {len(HEAD_STARTS)} times"


async def _overlap(run: Run, head_start: float) -> Verdict | None:
    """The slow request and its duplicate ``head_start`` s later; None if it was overtaken."""
    key, n = run.new_key(), run.new_n()
    started = time.monotonic()
    first = asyncio.ensure_future(run.send(key, n, slow=True))
    try:
        await asyncio.wait([first], timeout=head_start)
        if first.done():
            return "skip", f"the slow request answered within {head_start} s: not slow"
        sent = time.monotonic()
        duplicate = await run.send(key, n, slow=True)
        waited = time.monotonic() - sent
        still_running = not first.done()
        answered = await first
    finally:
        if not first.done():
            first.cancel()
    took = time.monotonic() - started
    seen = f"duplicate answered {duplicate.status_code} in {waited:.2f} s (first {took:.2f} s)"
    if answered.status_code == 409 and _ok(duplicate):
        return None
    if not still_running:
        return "fail", f"{seen}: held until the first finished ({answered.status_code})"
    if duplicate.status_code != 409:
        return "fail", f"{seen}: while the first was in flight, not 409"
    retry_after = duplicate.headers.get("retry-after")
    if _retry_after(duplicate) is None:
        return "fail", f"{seen}: Retry-After {retry_after!r} is not an integer of seconds"
    return "pass", f"{seen}, Retry-After: {retry_after}, while the first was in flight"


@check("completed-not-409", lambda _: 6)
async def completed_not_409(run: Run) -> Verdict:
    key, n = run.new_key(), run.new_n()
    first = (await run.execute(key, n))[-1]
    if not _ok(first):
        return "skip", "no first request succeeded (see first-request-succeeds)"
    duplicates = [await run.send(key, n) for _ in range(3)]
    seen = f"3 duplicates after completion: {_statuses(duplicates)}"
    if any(r.status_code == 409 for r in duplicates):
        return "fail", f"{seen}: a completed key answers its stored response, never 409"
    if any(r.status_code != first.status_code for r in duplicates):
        return "fail", f"{seen}, first {first.status_code}: not the stored status"
    return "pass", seen


@check("principal-isolation", lambda e: 6 if e.second_principal_headers else 0)
async def principal_isolation(run: Run) -> Verdict:
    if not run.endpoint.second_principal_headers:
        return "skip", "no second principal (--second-principal-header)"
    key, n = run.new_key(), run.new_n()
    first = (await run.execute(key, n))[-1]
    if not _ok(first):
        return "skip", "no first request succeeded (see first-request-succeeds)"
    answers, ran = await run.counting(run.execute(key, n, principal=2))
    other = answers[-1]
    seen = f"the second principal, same key and body: {other.status_code}" + _counted(ran)
    if not _ok(other):
        return "fail", f"{seen}: the key is shared across principals, it must run as its own"
    leaked = []
    if ran is None and _value(other.content) == _value(first.content):
        leaked.append("it received the first principal's answer")
    if _replay_marker(other):
        leaked.append(f"it is marked as a replay ({_replay_marker(other)})")
    if ran is not None and ran != 1:
        leaked.append("it did not run as its own")
    return ("fail", f"{seen}: " + "; ".join(leaked)) if leaked else ("pass", seen + ", its own")


@check("errors-are-problem-json", lambda _: 1)
async def errors_are_problems(run: Run) -> Verdict:
    if not run.errors:
        await run.send("", run.new_n())  # an empty key: an error answer to look at
    problems = [
        r
        for r in run.errors
        if r.headers.get("content-type", "").startswith("application/problem+json")
    ]
    others = [r for r in run.errors if r not in problems]
    seen = f"{len(problems)} of {len(run.errors)} error answers are application/problem+json"
    return "info", seen + (f"; not: {_statuses(others)}" if others else "")


@check("json-equivalence", lambda _: 4)
async def json_equivalence(run: Run) -> Verdict:
    n = run.new_n()
    try:
        value = json.loads(run.body(n))
    except ValueError:
        return "skip", "the body is not JSON"
    if isinstance(value, dict):
        value = dict(reversed(value.items()))
    elif not isinstance(value, list):
        return "skip", "the body is not a JSON object or array"
    key = run.new_key()
    first = (await run.execute(key, n))[-1]
    if not _ok(first):
        return "skip", "no first request succeeded (see first-request-succeeds)"
    other = await run.send(key, n, content=json.dumps(value, indent=2).encode())
    same = "the same JSON, re-spaced and reordered,"
    if _ok(other) and _value(other.content) == _value(first.content):
        return "info", f"{same} replays: keys fingerprint the value"
    if other.status_code == 422:
        return "info", f"{same} is 422: clients must resend the bytes"
    return "info", f"{same} answered {other.status_code}"


#: Every check's name, in the order they run: part of the interface.
CHECKS: tuple[str, ...] = tuple(c.name for c in _REGISTRY)


def _select(only: Sequence[str] | None, skip: Sequence[str] | None) -> list[Check]:
    unknown = sorted((set(only or ()) | set(skip or ())) - set(CHECKS))
    if unknown:
        msg = f"no such check: {', '.join(unknown)} (checks: {', '.join(CHECKS)})"
        raise ConfigurationError(msg)
    return [c for c in _REGISTRY if (not only or c.name in only) and c.name not in (skip or ())]


def _endpoint(url: str, in_process: bool, allow_remote: bool, options: dict[str, Any]) -> Endpoint:
    if in_process and url.startswith("/"):
        url = IN_PROCESS + url
    count_url = options.get("count_url")
    if count_url is not None:
        options["count_url"] = count_url = urljoin(url, count_url)
        if urlsplit(count_url)[:2] != urlsplit(url)[:2]:
            msg = f"the count URL {count_url} is not on {url}'s origin: the audit sends only there"
            raise ConfigurationError(msg)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        msg = f"not an http(s) URL: {url!r}"
        raise ConfigurationError(msg)
    if not (in_process or allow_remote or _is_loopback(parts.hostname)):
        msg = f"{parts.hostname} is not a loopback address: allow it explicitly (--yes)"
        raise ConfigurationError(msg)
    if int(options.get("concurrency", 20)) < 1:
        raise ConfigurationError("concurrency must be at least 1")
    return Endpoint(url=url, **options)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def plan(
    url: str,
    *,
    only: Sequence[str] | None = None,
    skip: Sequence[str] | None = None,
    **options: Any,
) -> str:
    """What `audit` with the same arguments will send, and at most how many requests."""
    endpoint = _endpoint(url, True, True, dict(options))
    checks = _select(only, skip)
    requests = sum(c.requests(endpoint) for c in checks)
    lines = [
        f"{len(checks)} checks, at most {requests} requests "
        f"({endpoint.concurrency} at once at most) to {endpoint.method} {endpoint.url}",
        f"  body: {_shown(endpoint.body)}  (n: a distinct integer per intent, from 1)",
        f"  Content-Type: {endpoint.content_type}; key: {endpoint.key_header}: audit-<random hex>",
    ]
    for label, headers in (
        ("first principal", endpoint.headers),
        ("second principal", endpoint.second_principal_headers),
        ("slow request", endpoint.slow_headers),
    ):
        if headers:
            lines.append(f"  {label}: " + ", ".join(f"{name}: <hidden>" for name in headers))
    if endpoint.slow_body:
        lines.append(f"  slow body: {_shown(endpoint.slow_body)}")
    if endpoint.count_url:
        lines.append(f"  count: GET {endpoint.count_url} before and after each counted burst")
    return "\n".join(lines)


def _shown(template: str) -> str:
    return template if len(template) <= 120 else template[:117] + "..."


def audit(url: str, **arguments: Any) -> Report:
    """Run the checks against ``url``: [`audit_async`][idemflow.audit.audit_async]'s
    arguments, on an event loop of its own."""
    return asyncio.run(audit_async(url, **arguments))


async def audit_async(
    url: str,
    *,
    asgi: Any = None,
    wsgi: Any = None,
    only: Sequence[str] | None = None,
    skip: Sequence[str] | None = None,
    allow_remote: bool = False,
    **options: Any,
) -> Report:
    """Run the checks against ``url`` (or ``asgi`` or ``wsgi`` in process, at that path);
    ``options``: docs/audit.md. Outside a loop: [`audit`][idemflow.audit.audit]."""
    if asgi is not None and wsgi is not None:
        raise ConfigurationError("give asgi or wsgi, not both")
    endpoint = _endpoint(url, asgi is not None or wsgi is not None, allow_remote, dict(options))
    checks = _select(only, skip)
    report = Report(endpoint.url)
    with _transport(asgi, wsgi, endpoint.concurrency) as transport:
        limits = httpx.Limits(max_connections=endpoint.concurrency + 2)
        async with httpx.AsyncClient(
            transport=transport, limits=limits, follow_redirects=False
        ) as client:
            run = Run(endpoint, client)
            for found in checks:
                report.checks.append(await _run_one(found, run))
    return report


async def _run_one(found: Check, run: Run) -> CheckResult:
    try:
        async with asyncio.timeout(CHECK_SECONDS):
            result, detail = await found.run(run)
    except TimeoutError:
        result, detail = "fail", f"no verdict within {CHECK_SECONDS:.0f} s"
    except (httpx.HTTPError, AuditError) as exc:
        result, detail = "fail", f"{type(exc).__name__}: {exc}"
    return CheckResult(found.name, result, detail)


@contextlib.contextmanager
def _transport(asgi: Any, wsgi: Any, concurrency: int) -> Iterator[httpx.AsyncBaseTransport | None]:
    if asgi is not None:
        yield httpx.ASGITransport(app=asgi)
    elif wsgi is not None:
        with ThreadPoolExecutor(concurrency + 2, thread_name_prefix="idemflow-audit") as pool:
            yield _ThreadedWSGI(httpx.WSGITransport(app=wsgi), pool)
    else:
        yield None


class _ThreadedWSGI(httpx.AsyncBaseTransport):
    """A WSGI app behind the async client, each request on a thread (a threaded server)."""

    def __init__(self, transport: httpx.WSGITransport, pool: ThreadPoolExecutor) -> None:
        self.transport = transport
        self.pool = pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        content = await request.aread()
        sync = httpx.Request(request.method, request.url, headers=request.headers, content=content)

        def call() -> httpx.Response:
            response = self.transport.handle_request(sync)
            response.read()
            return response

        response = await asyncio.get_running_loop().run_in_executor(self.pool, call)
        return httpx.Response(
            response.status_code, headers=response.headers, content=response.content
        )
