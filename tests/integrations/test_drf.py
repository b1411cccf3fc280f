"""
DRF's native form: ``@idempotent(serializer=…)`` on a real DRF view, on SQLite and PostgreSQL.

The serializer is validated once per request, before anything is claimed: an invalid
body is a 400 ``invalid-body`` problem carrying the serializer's errors, nothing
recorded, the view not run, so the corrected body under the same key runs (201) and
its retry replays. drf-spectacular's OpenAPI document of the action names the key
header, the problems and ``Idempotent-Replayed``, as FastAPI's does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("django")
pytest.importorskip("rest_framework")
pytest.importorskip("drf_spectacular")

from tests.integrations.django_setup import execute, require


class _URLs:
    urlpatterns: tuple[Any, ...] = ()


@dataclass
class App:
    alias: str
    table: str
    #: Amounts the view charged, and how often a serializer was validated.
    charged: list[int] = field(default_factory=list)
    validations: list[int] = field(default_factory=list)

    def post(self, body: object, key: str = "k-1", principal: str = "alice") -> Any:
        from django.test import Client

        return Client().post(
            "/drf/payments",
            data=json.dumps(body),
            content_type="application/json",
            headers={"Idempotency-Key": key, "X-User": principal},
        )

    def records(self) -> int:
        return int(execute(self.alias, f"SELECT count(*) FROM {self.table}")[0][0])


@pytest.fixture(params=["default", pytest.param("postgres", marks=pytest.mark.postgres)])
def app(request: pytest.FixtureRequest) -> Iterator[App]:
    from django.db import connections
    from django.test import override_settings
    from rest_framework import serializers
    from rest_framework.decorators import action
    from rest_framework.response import Response
    from rest_framework.routers import SimpleRouter
    from rest_framework.viewsets import ViewSet

    from idemflow.integrations.django import get_store, idempotent

    alias = request.param
    require(alias)
    made = App(alias, f"idem_{uuid.uuid4().hex[:12]}")
    settings = override_settings(
        IDEMFLOW={
            "database": alias,
            "table": made.table,
            "principal": lambda request: request.META.get("HTTP_X_USER"),
        },
        ROOT_URLCONF=_URLs,
        MIDDLEWARE=[],
        REST_FRAMEWORK={
            "UNAUTHENTICATED_USER": None,
            "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
        },
    )
    with settings:

        class PaymentIn(serializers.Serializer):  # type: ignore[misc]  # DRF has no stubs
            amount = serializers.IntegerField(min_value=1)
            currency = serializers.ChoiceField(choices=["EUR", "USD"])

            def is_valid(self, *, raise_exception: bool = False) -> bool:
                made.validations.append(1)
                return bool(super().is_valid(raise_exception=raise_exception))

        class PaymentViewSet(ViewSet):  # type: ignore[misc]
            authentication_classes = ()
            permission_classes = ()

            @idempotent(serializer=PaymentIn)
            def create(self, request: Any, serializer: Any) -> Any:
                made.charged.append(serializer.validated_data["amount"])
                return Response(serializer.data, status=201)

            @idempotent  # above @action, whose arguments would replace what it says
            @action(detail=False, methods=["post"])  # type: ignore[untyped-decorator]
            def refund(self, request: Any) -> Any:
                return Response(status=201)

        router = SimpleRouter(trailing_slash=False)
        router.register("drf/payments", PaymentViewSet, basename="payments")
        _URLs.urlpatterns = tuple(router.urls)
        get_store().migrate()
        try:
            yield made
        finally:
            connections[alias].close()
            execute(alias, f"DROP TABLE IF EXISTS {made.table}")


def test_an_invalid_body_is_a_problem_with_the_serializers_errors_and_nothing_recorded(
    app: App,
) -> None:
    refused = app.post({"amount": 0, "currency": "GBP"})

    assert refused.status_code == 400
    assert refused["Content-Type"] == "application/problem+json"
    problem = json.loads(refused.content)
    assert problem["type"] == "https://idemflow.dev/problems/invalid-body"
    assert set(problem["errors"]) == {"amount", "currency"}
    assert problem["detail"].startswith("amount: Ensure this value is greater than or equal to 1")
    assert problem["retryable"] is False
    assert (app.charged, app.records(), app.validations) == ([], 0, [1])


def test_the_corrected_body_under_the_same_key_runs_once_validated_once(app: App) -> None:
    app.post({"amount": 0, "currency": "EUR"})
    app.validations.clear()

    first = app.post({"amount": 10, "currency": "EUR"})
    assert (first.status_code, json.loads(first.content)) == (
        201,
        {"amount": 10, "currency": "EUR"},
    )
    assert (app.charged, app.validations, app.records()) == ([10], [1], 1)

    again = app.post({"amount": 10, "currency": "EUR"})
    assert (again.status_code, again["Idempotent-Replayed"]) == (201, "true")
    assert again.content == first.content
    assert app.charged == [10]

    other = app.post({"amount": 11, "currency": "EUR"})
    assert json.loads(other.content)["type"].endswith("/key-reused")
    assert app.charged == [10]


def test_the_openapi_document_names_the_key_the_problems_and_the_replay_header(
    app: App,
) -> None:
    from drf_spectacular.generators import SchemaGenerator
    from openapi_spec_validator import validate

    generator: Any = SchemaGenerator  # drf-spectacular's functions are untyped
    schema = generator(patterns=list(_URLs.urlpatterns)).get_schema(public=True)
    validate(schema)
    post = schema["paths"]["/drf/payments"]["post"]

    key = next(p for p in post["parameters"] if p["name"] == "Idempotency-Key")
    assert (key["in"], key["required"]) == ("header", True)
    body = post["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/PaymentIn"}
    responses = post["responses"]
    assert "Idempotent-Replayed" in responses["201"]["headers"]
    assert responses["201"]["content"]["application/json"]["schema"] == body
    for status in ("400", "401", "409", "413", "422", "503"):
        assert "application/problem+json" in responses[status]["content"], status
    assert {"409", "503"} <= {
        s for s, r in responses.items() if "Retry-After" in r.get("headers", {})
    }
