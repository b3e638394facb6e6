"""The ``tollgate`` command line: the admin API for scripts and CI (see README, "Command line")."""
