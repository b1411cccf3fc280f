"""The page's function view, and its DRF viewset where the page's DRF file is there."""

import importlib
import importlib.util

from django.urls import URLPattern, path
from payments.views import create_payment  # type: ignore[import-not-found]  # the page's

urlpatterns: list[URLPattern] = [path("payments", create_payment)]
if importlib.util.find_spec("payments.api") is not None:
    api = importlib.import_module("payments.api")
    urlpatterns.append(path("drf/payments", api.PaymentViewSet.as_view({"post": "create"})))
