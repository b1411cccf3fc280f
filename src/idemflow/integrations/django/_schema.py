"""What an ``@idempotent`` DRF action adds to drf-spectacular's operation (the key header, the
problems, the replay headers, ``serializer=`` as the body); the view's own words win."""

from __future__ import annotations

from typing import Any

from ..._extras import optional
from .._openapi import operation

with optional("idemflow.integrations.django"):
    from drf_spectacular.openapi import AutoSchema
    from rest_framework.settings import api_settings

__all__ = ["idempotent_schema"]


def idempotent_schema(view: Any, serializer: Any) -> type[AutoSchema] | None:
    """drf-spectacular's schema class for ``view``, or None when the project uses another."""
    base = getattr(view, "kwargs", {}).get("schema") or api_settings.DEFAULT_SCHEMA_CLASS
    base = base if isinstance(base, type) else type(base)
    if not issubclass(base, AutoSchema):
        return None

    class IdempotentSchema(base):  # type: ignore[valid-type,misc]
        def get_request_serializer(self) -> Any:
            return serializer if serializer is not None else super().get_request_serializer()

        def get_response_serializers(self) -> Any:
            found = super().get_response_serializers()
            return serializer if found is None else found

        def get_operation(self, *args: Any, **kwargs: Any) -> Any:
            generated = super().get_operation(*args, **kwargs)
            return None if generated is None else _merged(generated, self.method)

    return IdempotentSchema


def _merged(generated: dict[str, Any], method: str) -> dict[str, Any]:
    responses: dict[str, Any] = generated.setdefault("responses", {})
    default = "201" if method == "POST" else "200"
    success = next((status for status in responses if status.startswith("2")), default)
    ours = operation(success)
    known = {(p.get("name", "").lower(), p.get("in")) for p in generated.get("parameters", [])}
    added = [p for p in ours["parameters"] if (p["name"].lower(), p["in"]) not in known]
    generated["parameters"] = [*generated.get("parameters", []), *added]
    for status, answer in ours["responses"].items():
        theirs = responses.setdefault(status, {})
        theirs.setdefault("description", answer.get("description", ""))
        for part in ("content", "headers"):
            if part in answer:
                theirs[part] = {**answer[part], **theirs.get(part, {})}
    return generated
