"""
The Flask example: one protected endpoint, its payment row and the stored response
committed in ``db.session``'s transaction.

    SHOP_DATABASE_URL=sqlite:////tmp/flask-shop.db flask --app app init-db
    SHOP_DATABASE_URL=sqlite:////tmp/flask-shop.db flask --app app idemflow migrate
    gunicorn -k gthread --threads 8 app:app

The caller names itself in ``X-User`` (stand-in authentication through
Flask-Login's request loader). Test hooks, not part of the pattern:
``X-Fail: 503`` answers a transient 503, ``X-Hold: <path>`` keeps the request
running until that file exists (at most 10 s or ``SHOP_HOLD_LIMIT`` seconds;
it creates ``<path>.waiting`` when it starts to wait),
``X-Hold-After-Write: <path>`` the same after the payment row was written
(PostgreSQL only: the fault tests kill or outlive a request whose row is pending);
``SHOP_REQUEST_TIMEOUT`` shortens the request timeout (and so the stale threshold)
for the fault tests. ``/_bench/payments`` is the endpoint without idemflow, for
bench/bench_frameworks.py only.
"""

import os
import time

from flask import Flask, Request, abort, request
from flask_login import LoginManager, UserMixin, current_user
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from idemflow.integrations.flask import Idempotency

app = Flask(__name__)
app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get(
    "SHOP_DATABASE_URL", "sqlite:////tmp/flask-shop.db"
).replace("postgresql://", "postgresql+psycopg://", 1)
# A pooled connection is tested before a request gets it: one the database closed (a
# restart, a failover) is replaced instead of failing the view's first statement, which
# Flask would answer with a 500 (idemflow gives the key back: nothing is recorded).
app.config["IDEMFLOW_REQUEST_TIMEOUT"] = float(os.environ.get("SHOP_REQUEST_TIMEOUT", "10"))
# A free connection within idemflow's store wait (half the request timeout, at most 5 s),
# or idemflow refuses the engine: a request never waits for one past its budget.
store_wait = min(app.config["IDEMFLOW_REQUEST_TIMEOUT"] / 2, 5)
app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {"pool_pre_ping": True, "pool_timeout": store_wait}
# SHOP_MAX_CONTENT_LENGTH: Flask's cap on a request body (the tests set it below idemflow's
# IDEMFLOW_MAX_BODY_BYTES: the lower of the two bounds a protected request's body).
if os.environ.get("SHOP_MAX_CONTENT_LENGTH"):
    app.config["MAX_CONTENT_LENGTH"] = int(os.environ["SHOP_MAX_CONTENT_LENGTH"])


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(app, model_class=Base)
login = LoginManager(app)


class User(UserMixin):
    def __init__(self, name: str) -> None:
        self.id = name


def from_header(req: Request) -> User | None:
    name = req.headers.get("X-User")
    return User(name) if name else None


login.request_loader(from_header)


class Payment(Base):
    __tablename__ = "payment"
    id: Mapped[int] = mapped_column(primary_key=True)
    principal: Mapped[str] = mapped_column(String(255))
    amount: Mapped[int]


idem = Idempotency(app, db=db)  # principal: Flask-Login's current_user


def valid_amount() -> None:
    body = request.get_json(silent=True)
    amount = body.get("amount") if isinstance(body, dict) else None
    if not isinstance(amount, int) or amount <= 0:
        abort(400, 'send {"amount": <positive int>}')


def hold(header: str) -> None:
    """A test hook: wait until the file the header names exists (with a deadline)."""
    gate = request.headers.get(header)
    if gate:
        open(f"{gate}.waiting", "w").close()  # tells the test the request got this far
    deadline = time.monotonic() + float(os.environ.get("SHOP_HOLD_LIMIT", "10"))
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)  # polled by the test, with a deadline


@app.post("/payments")
@idem.protect(validate=valid_amount)
def create_payment() -> tuple[dict[str, object], int]:
    # The slow part (a provider's call) before the first write: on SQLite a transaction
    # that wrote holds the one write lock, and a duplicate's claim would queue behind it.
    hold("X-Hold")
    payment = Payment(principal=current_user.get_id(), amount=request.json["amount"])
    db.session.add(payment)
    db.session.flush()
    hold("X-Hold-After-Write")
    if request.headers.get("X-Fail") == "503":
        return {"error": "provider unavailable"}, 503
    return {"id": payment.id, "amount": payment.amount}, 201


# Benchmark only (bench/bench_frameworks.py): the endpoint above without idemflow, the
# same validation and write, committed by the view itself. Not a pattern to copy.
@app.post("/_bench/payments")
def create_payment_unprotected() -> tuple[dict[str, object], int]:
    if not current_user.is_authenticated:
        abort(401)
    valid_amount()
    payment = Payment(principal=current_user.get_id(), amount=request.json["amount"])
    db.session.add(payment)
    db.session.flush()
    # Read before the commit expires it.
    answer: dict[str, object] = {"id": payment.id, "amount": payment.amount}
    db.session.commit()
    return answer, 201


@app.cli.command("init-db")
def init_db() -> None:
    """Create the example's own tables."""
    db.create_all()
