from django.urls import path

from . import views

urlpatterns = [
    path("payments", views.create_payment),
    path("cbv/payments", views.PaymentView.as_view()),
    path("drf/payments", views.PaymentViewSet.as_view({"post": "create"})),
    path("mw/payments", views.middleware_payment),
    # Benchmark only: the DRF action without idemflow (bench/bench_frameworks.py).
    path("_bench/drf/payments", views.UnprotectedPaymentViewSet.as_view({"post": "create"})),
]
