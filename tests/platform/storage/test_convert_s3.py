"""``data convert`` to an object store uploads the HDF5 and does not leave its staged copy (gigabytes for a
release's features) behind; an upload that fails is one line naming ``dst``."""

from __future__ import annotations

import shutil

import h5py

from prvrlab.data.bigfile import BigFile
from prvrlab.platform import storage
from prvrlab.platform.cli import EXIT_BAD_INPUT, main

from s3_helpers import s3_client, s3_endpoint


def test_convert_to_s3_uploads_and_drops_the_staged_file(tmp_path, tiny_root, monkeypatch, capsys):
    monkeypatch.setenv("PRVRLAB_STAGING", str(tmp_path / "staging"))
    src = tmp_path / "feat"
    shutil.copytree(tiny_root / "FeatureData" / "synth_feat", src)
    with s3_endpoint("bkt") as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert main(["data", "convert", str(src), "s3://bkt/f/feat.h5", "--quiet"]) == 0
        assert "wrote s3://bkt/f/feat.h5" in capsys.readouterr().out
        staged = storage.Location("s3://bkt/f/feat.h5").local
        assert not staged.exists()
        body = s3_client(env).get_object(Bucket="bkt", Key="f/feat.h5")["Body"].read()
        (tmp_path / "back.h5").write_bytes(body)
        with h5py.File(tmp_path / "back.h5") as f:
            assert sorted(f) == sorted(BigFile(src).video_ids())
        monkeypatch.setattr(storage, "put", lambda local, uri: (_ for _ in ()).throw(OSError("access denied")))
        assert main(["data", "convert", str(src), "s3://bkt/f/again.h5", "--quiet"]) == EXIT_BAD_INPUT
        assert "prvrlab: error: dst s3://bkt/f/again.h5: cannot be written (access denied)" in capsys.readouterr().err
        assert not storage.Location("s3://bkt/f/again.h5").local.exists()
