"""Trials whose saved checkpoint is gone when a study resumes.

Tune deletes a trial's older checkpoint as soon as it registers a newer one (``num_to_keep``) but
saves its experiment state only every few seconds: a driver killed in between leaves a state that
names a checkpoint no longer on storage, and Tune's restore then fails the trial ("does not exist
on storage anymore") instead of running it again. Before any trial starts, :func:`repair_checkpoints`
points such a trial at the newest checkpoint its folder still holds (with that report's metrics from
``result.json``, so the iteration count and the schedulers' milestones go on from there), or at none:
the trial then trains again from the start.
"""

from __future__ import annotations

import json
import re
from typing import Any

CHECKPOINT_DIR = re.compile(r"checkpoint_(\d+)$")
RESULT_FILE = "result.json"


def _newest_checkpoint(fs, trial_path: str) -> tuple[int, str] | None:
    """(index, path) of the highest-numbered ``checkpoint_*`` folder under ``trial_path``."""
    from pyarrow import fs as pafs

    found = []
    for info in fs.get_file_info(pafs.FileSelector(trial_path, allow_not_found=True)):
        match = CHECKPOINT_DIR.match(info.base_name)
        if match and info.type == pafs.FileType.Directory:
            found.append((int(match.group(1)), info.path))
    return max(found) if found else None


def _report_of(fs, trial_path: str, name: str) -> dict[str, Any]:
    """The last ``result.json`` row that saved checkpoint ``name`` (empty when none is readable)."""
    try:
        with fs.open_input_stream(f"{trial_path}/{RESULT_FILE}") as stream:
            lines = stream.read().decode("utf-8", errors="replace").splitlines()
    except (OSError, FileNotFoundError):
        return {}
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:  # a row cut short by the kill
            continue
        if isinstance(row, dict) and row.get("checkpoint_dir_name") == name:
            return row
    return {}


def repair_checkpoints(trials) -> dict[str, str]:
    """Repoint (or clear) the latest checkpoint of every trial whose checkpoint is missing on storage;
    returns trial id -> what was done, for the trial's run."""
    from ray.train import Checkpoint
    from ray.train._internal.session import _TrainingResult
    from ray.train._internal.storage import _exists_at_fs_path  # the check Tune's restore raises on

    notes: dict[str, str] = {}
    for trial in trials:
        manager = trial.run_metadata.checkpoint_manager
        latest = manager.latest_checkpoint_result
        if latest is None or _exists_at_fs_path(latest.checkpoint.filesystem, latest.checkpoint.path):
            continue
        missing = latest.checkpoint.path.rstrip("/").rsplit("/", 1)[-1]
        fs, trial_path = trial.storage.storage_filesystem, trial.storage.trial_fs_path
        newest = _newest_checkpoint(fs, trial_path)
        if newest is None:
            manager._checkpoint_results, manager._latest_checkpoint_result = [], None
            notes[trial.trial_id] = f"{missing} was gone on resume and no other checkpoint was left: trained again from the start"
        else:
            index, path = newest
            name = path.rstrip("/").rsplit("/", 1)[-1]
            kept = _TrainingResult(checkpoint=Checkpoint(path, filesystem=fs), metrics=_report_of(fs, trial_path, name))
            manager._checkpoint_results, manager._latest_checkpoint_result = [kept], kept
            trial.storage.current_checkpoint_index = max(trial.storage.current_checkpoint_index, index)  # the last one written
            notes[trial.trial_id] = f"{missing} was gone on resume: resumed from {name}"
        trial.invalidate_json_state()
        trial.run_metadata.invalidate_cache()
    return notes
