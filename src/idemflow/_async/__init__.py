"""
The I/O shells of the core: driver, HTTP edge, sweeper, transaction adapters.

Each module here is the async source of truth of its twin in ``idemflow/_sync/``.
This is the async source of truth; ``idemflow/_sync/__init__.py`` is generated
from it by ``scripts/unasync.py``.
"""
