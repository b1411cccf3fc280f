"""
The peers of ``bench/bench_peers.py``: one app per package, each the minimal endpoint of
``bench/_thing.py`` protected by that package's own API, run in its own virtualenv.
"""
