"""The one exception type the data layer raises for bad input files."""

from __future__ import annotations


class DataError(Exception):
    """A missing, malformed or inconsistent data file.

    The message always names the offending file, and the video or query id
    when one is involved, so the user can find the problem without a debugger.
    """
