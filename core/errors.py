"""Errors the services raise that every caller (API, console, commands) understands."""

from django.core.exceptions import ValidationError


class Conflict(ValidationError):
    """The request clashes with the current state (a name is taken, an object is in a state
    that forbids the action). A ValidationError, so forms and commands show it as before; the
    admin API answers it with 409."""
