"""The one error type of the reports (the CLI turns it into one message and exit code 2)."""

from __future__ import annotations


class ReportError(RuntimeError):
    """A study or config that cannot be found or read (unknown run id, experiment, study, feature sizes)."""
