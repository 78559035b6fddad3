"""The hint for a lone recovery checkpoint points at the config where training writes it: <run>/files/config.yaml
(the run folder's top holds no config.yaml)."""

from __future__ import annotations

import pytest

from prvrlab.platform.config import ConfigError
from prvrlab.platform.train.checkpoint_eval import _with_run_config, recovery_config


def test_the_hint_names_the_files_folder_that_recovery_config_reads(tmp_path):
    lone = tmp_path / "lone.pt"
    lone.write_bytes(b"")
    with pytest.raises(ConfigError) as caught:
        _with_run_config({}, lone, None)
    hinted = str(caught.value).rsplit("--config ", 1)[1]
    assert hinted == "<run folder>/files/config.yaml"
    run = tmp_path / "run"
    state = run / "files" / "local_session" / "checkpoint_latest" / "state.pt"
    state.parent.mkdir(parents=True)
    state.write_bytes(b"")
    written = run / hinted.replace("<run folder>/", "")
    written.write_text("name: run\n")
    assert recovery_config(state) == written.resolve()
