"""Exceptions raised by the load-test harness.

Every message is a single line so the CLI can print ``error: <message>`` and
exit without a traceback.
"""

from __future__ import annotations


class LoadTestError(Exception):
    """Base class: a problem with the user's input or environment, not a bug."""


class ConfigError(LoadTestError, ValueError):
    """A :class:`~loadtests.config.BenchConfig` field has an invalid value."""


class DatasetError(LoadTestError):
    """The dataset spec or dataset file cannot be used."""


class ServerUnreachableError(LoadTestError):
    """The server did not answer ``GET /v1/models`` (or did not list a model)."""
