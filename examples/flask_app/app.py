"""
The Flask example: one protected endpoint, its payment row and the stored response
committed in ``db.session``'s transaction.

    SHOP_DATABASE_URL=sqlite:////tmp/flask-shop.db flask --app app init-db
    SHOP_DATABASE_URL=sqlite:////tmp/flask-shop.db flask --app app idemflow migrate
    gunicorn -k gthread --threads 8 app:app

The caller names itself in ``X-User`` (stand-in authentication through
Flask-Login's request loader). Test hooks, not part of the pattern:
``X-Fail: 503`` answers a transient 503, ``X-Hold: <path>`` keeps the request
running until that file exists.
"""

import os
import time

from flask import Flask, abort, request
from flask_login import LoginManager, UserMixin, current_user
from flask_sqlalchemy import SQLAlchemy

from idemflow.integrations.flask import Idempotency

app = Flask(__name__)
app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get(
    "SHOP_DATABASE_URL", "sqlite:////tmp/flask-shop.db"
).replace("postgresql://", "postgresql+psycopg://", 1)
app.config["IDEMFLOW_REQUEST_TIMEOUT"] = 10
db = SQLAlchemy(app)
login = LoginManager(app)


class User(UserMixin):
    def __init__(self, name: str) -> None:
        self.id = name


@login.request_loader
def from_header(req):
    name = req.headers.get("X-User")
    return User(name) if name else None


class Payment(db.Model):
    id = db.Column(db.Integer, primary_key=True)
    principal = db.Column(db.String(255), nullable=False)
    amount = db.Column(db.Integer, nullable=False)


idem = Idempotency(app, db=db)  # principal: Flask-Login's current_user


def valid_amount() -> None:
    body = request.get_json(silent=True)
    amount = body.get("amount") if isinstance(body, dict) else None
    if not isinstance(amount, int) or amount <= 0:
        abort(400, 'send {"amount": <positive int>}')


@app.post("/payments")
@idem.protect(validate=valid_amount)
def create_payment():
    # The slow part (a provider's call) before the first write: on SQLite a transaction
    # that wrote holds the one write lock, and a duplicate's claim would queue behind it.
    hold = request.headers.get("X-Hold")
    deadline = time.monotonic() + 10
    while hold and not os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.01)  # polled by the test, with a deadline
    payment = Payment(principal=current_user.get_id(), amount=request.json["amount"])
    db.session.add(payment)
    db.session.flush()
    if request.headers.get("X-Fail") == "503":
        return {"error": "provider unavailable"}, 503
    return {"id": payment.id, "amount": payment.amount}, 201


@app.cli.command("init-db")
def init_db() -> None:
    """Create the example's own tables."""
    db.create_all()
