import contextlib

with contextlib.suppress(ImportError):
    import pymysql.connections

    # PyMySQL (1.2) asks for TLS on every connection not told otherwise, and first builds
    # a TLS context from the system's CA bundle: ~65 ms of CPU per connection, the most of
    # a MySQL or Galera test's setup. No test server offers TLS (PyMySQL then goes on in
    # plain TCP), so no test loses anything: the context is not built. Set here, not in
    # conftest.py: the race tests' child processes import ``tests`` too.
    pymysql.connections.SSL_ENABLED = False
