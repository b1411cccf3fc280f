"""Framework glue, one module per framework, each imported by path (optional dependencies)."""
