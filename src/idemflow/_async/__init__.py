"""Async shells: the only code that awaits. ``../_sync`` is generated from here."""
