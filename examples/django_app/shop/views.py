"""
Four ways to protect ``POST …/payments``; each writes one Payment row in the
transaction idemflow writes its completion in.

Test hooks (not part of the pattern): ``X-Fail: 503`` answers a transient 503
(nothing stored: the retry runs), ``X-Hold: <path>`` keeps the request running
until that file exists (to observe the 409 of a duplicate), at most 10 s or
``SHOP_HOLD_LIMIT`` seconds, and creates ``<path>.waiting`` when it starts to
wait; ``X-Hold-After-Write: <path>`` holds the same way after the payment row was
written, uncommitted (PostgreSQL and MariaDB only: the fault tests kill or outlive
a request whose row is pending).
``/_bench/drf/payments`` is the DRF action without idemflow, for
bench/bench_frameworks.py only.
"""

import json
import os
import time

from django.core.exceptions import BadRequest
from django.http import JsonResponse
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework import serializers, viewsets
from rest_framework.response import Response

from idemflow.integrations.django import idempotent

from .models import Payment


def _amount(request) -> int:
    try:
        amount = json.loads(request.body)["amount"]
    except (ValueError, KeyError, TypeError):
        raise BadRequest('send {"amount": <int>}') from None
    if not isinstance(amount, int) or amount <= 0:
        raise BadRequest("amount must be a positive integer")
    return amount


def _hold(request, header: str = "X-Hold") -> None:
    """The slow part (a provider's call) comes before the first write: on SQLite a
    transaction that wrote holds the one write lock, and a duplicate's claim would queue."""
    hold = request.headers.get(header)
    if hold:
        open(f"{hold}.waiting", "w").close()  # tells the test the request got this far
    deadline = time.monotonic() + float(os.environ.get("SHOP_HOLD_LIMIT", "10"))
    while hold and not os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.01)  # polled by the test, with a deadline: not synchronisation


def _failed(request) -> bool:
    return request.headers.get("X-Fail") == "503"


def _pay(request, via: str) -> JsonResponse:
    amount = _amount(request)
    _hold(request)
    payment = Payment.objects.create(principal=str(request.user.pk), amount=amount, via=via)
    _hold(request, "X-Hold-After-Write")
    if _failed(request):  # rolled back with the payment: nothing happened
        return JsonResponse({"error": "provider unavailable"}, status=503)
    return JsonResponse({"id": payment.pk, "amount": amount}, status=201)


# 1. A function view: the decorator is the whole integration.
@idempotent(validate=_amount)
def create_payment(request):
    return _pay(request, "function")


# 2. A class-based view's method.
@method_decorator(idempotent(validate=_amount), name="post")
class PaymentView(View):
    def post(self, request):
        return _pay(request, "cbv")


# 3. A DRF action: DRF authenticates first; the serializer is validated once, before the
# claim (invalid: a 400 problem with its errors, nothing recorded), and handed to the view.
class PaymentIn(serializers.Serializer):
    amount = serializers.IntegerField(min_value=1)


class PaymentViewSet(viewsets.ViewSet):
    @idempotent(serializer=PaymentIn)
    def create(self, request, serializer):
        amount = serializer.validated_data["amount"]
        _hold(request)
        payment = Payment.objects.create(principal=str(request.user.pk), amount=amount, via="drf")
        _hold(request, "X-Hold-After-Write")
        if _failed(request):
            return Response({"error": "provider unavailable"}, status=503)
        return Response({"id": payment.pk, "amount": amount}, status=201)


# 4. Protected by IdempotencyMiddleware (IDEMFLOW["endpoints"]): no decorator.
def middleware_payment(request):
    return _pay(request, "middleware")


# Benchmark only (bench/bench_frameworks.py): the DRF action above without idemflow, the
# same validation and write in Django's autocommit. Not a pattern to copy.
class UnprotectedPaymentViewSet(viewsets.ViewSet):
    def create(self, request):
        PaymentIn(data=request.data).is_valid(raise_exception=True)
        amount = request.data["amount"]
        payment = Payment.objects.create(principal=str(request.user.pk), amount=amount, via="drf")
        return Response({"id": payment.pk, "amount": amount}, status=201)
