import contextlib

with contextlib.suppress(ImportError):
    import pymysql.connections

    # For the PyMySQL connections the tests open themselves (the backends' setup and
    # teardown, the callers' transactions, test_mysql's and test_galera's connect(), the
    # stores built on a factory of the tests', Galera's polls): told nothing about TLS,
    # PyMySQL (1.2) builds a TLS context from the system's CA bundle for each, ~20-65 ms
    # of CPU (474 connections in test_mysql.py alone). The stores no longer need it (their
    # connections share one context); the tests of that path set it back
    # (tests/stores/test_mysql_tls.py). No test server but that file's offers TLS. Set
    # here, not in conftest.py: the race tests' child processes import ``tests`` too.
    pymysql.connections.SSL_ENABLED = False
