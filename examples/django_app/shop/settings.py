"""
Settings of the example shop. The database comes from ``SHOP_DATABASE_URL``:
``sqlite:////tmp/shop.db`` (the default), ``postgresql://user@host:5432/db``
or ``mysql://user:pw@host:3306/db`` (through PyMySQL).
"""

import os
from urllib.parse import unquote, urlsplit

SECRET_KEY = "example-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "shop.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "rest_framework",
    "idemflow.integrations.django",  # the key table's migration, idemflow_sweep/idemflow_purge
    "shop",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "shop.auth.HeaderUserMiddleware",
    "idemflow.integrations.django.middleware.IdempotencyMiddleware",
]
SESSION_ENGINE = "django.contrib.sessions.backends.signed_cookies"


def _database(url: str) -> dict:
    parts = urlsplit(url)
    atomic_requests = os.environ.get("SHOP_ATOMIC_REQUESTS") == "1"
    if parts.scheme == "sqlite":
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": parts.path[1:] if parts.path.startswith("//") else parts.path.lstrip("/"),
            "OPTIONS": {"init_command": "PRAGMA journal_mode=WAL", "timeout": 10},
            "ATOMIC_REQUESTS": atomic_requests,
        }
    common = {
        "NAME": parts.path.lstrip("/"),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": str(parts.port or ""),
        "ATOMIC_REQUESTS": atomic_requests,
        # SHOP_CONN_MAX_AGE: persistent connections (bench/bench_frameworks.py sets it).
        "CONN_MAX_AGE": int(os.environ.get("SHOP_CONN_MAX_AGE", "0")),
    }
    if parts.scheme.startswith("postgres"):
        # SHOP_SERVER_SIDE_BINDING=1: psycopg binds values on the server, and prepares
        # what runs often (bench/bench_django_binding.py compares the two).
        binding = os.environ.get("SHOP_SERVER_SIDE_BINDING") == "1"
        options: dict = {"server_side_binding": True} if binding else {}
        # SHOP_POOL_SIZE: Django's psycopg pool of that many connections per process, whose
        # checkout waits SHOP_POOL_TIMEOUT seconds at most (the pool tests set them).
        if os.environ.get("SHOP_POOL_SIZE"):
            options["pool"] = {
                "min_size": 0,
                "max_size": int(os.environ["SHOP_POOL_SIZE"]),
                "timeout": float(os.environ.get("SHOP_POOL_TIMEOUT", "10")),
            }
        return {**common, "ENGINE": "django.db.backends.postgresql", "OPTIONS": options}
    import pymysql  # Django's MySQL backend speaks mysqlclient's interface; PyMySQL offers it

    pymysql.install_as_MySQLdb()
    return {**common, "ENGINE": "django.db.backends.mysql", "OPTIONS": {"charset": "utf8mb4"}}


DATABASES = {"default": _database(os.environ.get("SHOP_DATABASE_URL", "sqlite:////tmp/shop.db"))}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["shop.auth.HeaderAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
}

# SHOP_DATA_UPLOAD_MAX_MEMORY_SIZE: Django's cap on a body read into memory (the tests set it
# below idemflow's max_body_bytes: the lower of the two bounds a protected request's body).
if os.environ.get("SHOP_DATA_UPLOAD_MAX_MEMORY_SIZE"):
    DATA_UPLOAD_MAX_MEMORY_SIZE = int(os.environ["SHOP_DATA_UPLOAD_MAX_MEMORY_SIZE"])

IDEMFLOW = {
    # SHOP_REQUEST_TIMEOUT: the fault tests shorten it so the stale threshold is seconds.
    "request_timeout": float(os.environ.get("SHOP_REQUEST_TIMEOUT", "10")),
    "auth_middleware": ["shop.auth.HeaderUserMiddleware"],
    # The middleware protects these; the other endpoints use @idempotent.
    "endpoints": ["POST /mw/payments"],
}
