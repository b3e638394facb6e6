"""The ``tollgate`` command line: the admin API for scripts and CI (see docs/reference/cli.md)."""
