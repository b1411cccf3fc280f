"""The I/O shells of the core.
This is the async source of truth; ``idemflow/_sync/__init__.py`` is generated from it by
``scripts/unasync.py``."""
