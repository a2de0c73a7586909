"""CLI tests (a package so their module names do not clash with tests/ at the top level)."""
