"""Ray's and Tune's log lines go to a log file, not to the console (errors excepted).

Ray's Python loggers all hang under the ``ray`` logger, which has its own
stderr handler and does not propagate.  ``ray.init(logging_level="ERROR")``
(what :func:`prvrlab.platform.runtime.ensure_ray` asks for) drops every
warning outright — Tune's "Experiment state snapshotting has been triggered
multiple times", Train's controller notes — so nobody can read them later.
:func:`ray_logs_to` keeps them: while it is active the ``ray`` logger records
``INFO`` and above into a file (the study's ``study.log``) and its console
handlers let only errors through; Python warnings (``warnings.warn``, e.g.
Ray's deprecation notices) go to the same file instead of stderr.  Tune's
error with the full traceback of each failed trial attempt ("Trial task
failed for trial ...") goes to the file only: the console's progress line
says what failed in one line, and the trial's ``error.txt`` (an artifact of
its MLflow run) keeps every attempt's traceback.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FILE_ONLY = ("Trial task failed for trial ",)  # how the error records the console leaves out begin


class _FileOnly(logging.Filter):
    """Leaves out the records :data:`FILE_ONLY` names (on the console handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(FILE_ONLY)


@contextmanager
def ray_logs_to(path: Path, level: int = logging.INFO) -> Iterator[Path]:
    """Send the ``ray`` logger tree and Python warnings to ``path`` (appended); the console keeps errors.

    Everything is put back on exit (levels, handlers, ``logging.captureWarnings``).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.setLevel(level)
    ray_logger, warn_logger = logging.getLogger("ray"), logging.getLogger("py.warnings")
    console = [h for h in ray_logger.handlers if not isinstance(h, logging.FileHandler)]
    saved = {
        "ray_level": ray_logger.level,
        "console": [(h, h.level) for h in console],
        "warn_propagate": warn_logger.propagate,
    }
    file_only = _FileOnly()
    for h in console:
        h.setLevel(max(h.level, logging.ERROR))
        h.addFilter(file_only)
    ray_logger.setLevel(level)
    ray_logger.addHandler(handler)
    warn_logger.addHandler(handler)
    warn_logger.propagate = False
    logging.captureWarnings(True)
    try:
        yield path
    finally:
        logging.captureWarnings(False)
        warn_logger.propagate = saved["warn_propagate"]
        warn_logger.removeHandler(handler)
        ray_logger.removeHandler(handler)
        ray_logger.setLevel(saved["ray_level"])
        for h, lvl in saved["console"]:
            h.setLevel(lvl)
            h.removeFilter(file_only)
        handler.close()
