"""Storage locations by URI: parsing at the config edge, staging folders, pushes and pulls (local S3 endpoint)."""

from __future__ import annotations

import io
import os

import pytest
import yaml

from prvrlab.platform import storage
from prvrlab.platform.cli import EXIT_BAD_INPUT, main
from prvrlab.platform.config import ConfigError, validate
from prvrlab.platform.runtime import resolve_config_paths

from s3_helpers import bucket_keys, s3_client, s3_endpoint
from search_helpers import tiny_spec
from train_helpers import small_raw


@pytest.mark.parametrize(
    "given, expected",
    [
        ("s3://lab/runs/", "s3://lab/runs"),
        ("S3://lab", "s3://lab"),
        ("gcs://lab/a//b", "gs://lab/a//b"),
        ("gs://lab/a/b", "gs://lab/a/b"),
        ("file:///srv/res%20ults", "/srv/res ults"),
        ("file://localhost/srv/x", "/srv/x"),
    ],
)
def test_normalize_gives_one_spelling_per_location(given, expected):
    assert storage.normalize(given) == expected


def test_normalize_resolves_relative_local_paths_against_the_base(tmp_path):
    assert storage.normalize("results/a", tmp_path) == str(tmp_path / "results" / "a")
    assert storage.normalize(str(tmp_path / "x" / ".." / "y"), tmp_path) == str(tmp_path / "y")


@pytest.mark.parametrize(
    "given, words",
    [
        ("hdfs://nn/results", ["unknown scheme 'hdfs://'"]),
        ("s3:///results", ["names no bucket"]),
        ("s3://lab/runs?endpoint_override=http://127.0.0.1:9000", ["carries a query", "AWS_ENDPOINT_URL"]),
        ("file://otherhost/srv", ["names host 'otherhost'"]),
        ("s3://lab/runs/../../../home", ["'..' segment"]),  # its local staging copy would leave the staging folder
        ("gs://../x", ["'..' segment"]),
        ("s3://lab/./x", ["'.' or '..' segment"]),
    ],
)
def test_bad_storage_uris_are_refused_at_validation_naming_the_key(tiny_root, tmp_path, given, words):
    raw = small_raw(tiny_root, tmp_path)
    raw["tracking"]["storage_path"] = given
    with pytest.raises(ConfigError) as err:
        validate(raw)
    assert str(err.value).startswith("tracking.storage_path: ")
    for word in words:
        assert word in str(err.value)


def test_cli_refuses_an_unknown_scheme_in_one_line_exit_2(tiny_root, tmp_path, capsys):
    raw = small_raw(tiny_root, tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["train", str(cfg), "--set", "tracking.storage_path=ftp://host/x", "--no-ray"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tracking.storage_path" in err[0] and "ftp://" in err[0]
    assert not (tmp_path / "mlflow.db").exists()  # refused before any store is opened


def test_resolved_config_keeps_object_store_uris_and_turns_file_uris_into_paths(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path)
    raw["tracking"]["storage_path"] = "gcs://lab/x/"
    assert resolve_config_paths(validate(raw), cwd=tmp_path).tracking.storage_path == "gs://lab/x"
    raw["tracking"]["storage_path"] = f"file://{tmp_path}/r"
    assert resolve_config_paths(validate(raw), cwd=tmp_path).tracking.storage_path == str(tmp_path / "r")


def test_locations_map_object_stores_to_a_private_staging_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PRVRLAB_STAGING", str(tmp_path / "stage"))
    run = storage.Location("s3://lab/runs").child("a", "files")
    assert run.uri == "s3://lab/runs/a/files" and run.remote and run.name == "files"
    assert run.local == tmp_path / "stage" / "s3" / "lab" / "runs" / "a" / "files"
    assert (tmp_path / "stage").stat().st_mode & 0o777 == 0o700
    local = storage.Location(str(tmp_path / "res")).child("a")
    assert not local.remote and local.local == tmp_path / "res" / "a"
    assert local.pull() == 0 and storage.Mirror(local.local, None).push() == 0  # local storage: nothing to sync


def test_a_staging_folder_others_can_write_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("PRVRLAB_STAGING", str(shared))
    with pytest.raises(ConfigError, match="PRVRLAB_STAGING"):
        storage.Location("s3://lab/x").local


@pytest.fixture(scope="module")
def s3():
    with s3_endpoint("lab") as env:
        yield env


@pytest.fixture
def s3_env(s3, tmp_path, monkeypatch):
    for key, value in {**s3, "PRVRLAB_STAGING": str(tmp_path / "stage")}.items():
        monkeypatch.setenv(key, value)
    return s3


class _Recorder:
    """A stand-in object store recording the order of uploads."""

    def __init__(self) -> None:
        self.written: list[str] = []

    def open_output_stream(self, path: str):
        self.written.append(path)
        return io.BytesIO()


def test_mirror_pushes_an_index_after_the_files_it_names(tmp_path, monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(storage, "_filesystem", lambda uri: (recorder, "bkt/study"))
    (tmp_path / "trials" / "t1").mkdir(parents=True)
    for rel in ("study.json", "a.log", "trials/t1/outcome.json"):
        (tmp_path / rel).write_text(rel)
    assert storage.Mirror(tmp_path, "s3://bkt/study", last=("study.json",)).push() == 3
    assert recorder.written == ["bkt/study/a.log", "bkt/study/trials/t1/outcome.json", "bkt/study/study.json"]
    recorder.written.clear()
    assert storage.Mirror(tmp_path, "s3://bkt/study").push() == 3
    assert recorder.written[0] == "bkt/study/a.log" and recorder.written[1] == "bkt/study/study.json"  # plain name order


def test_mirror_pushes_changed_files_only_and_never_progress_or_excluded(s3_env, tmp_path):
    folder = tmp_path / "run"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("one")
    (folder / "sub" / "b.txt").write_text("two")
    (folder / "progress.json").write_text("{}")
    (folder / "best_model.pt").write_bytes(b"w")
    mirror = storage.Mirror(folder, "s3://lab/m1", exclude=storage.WORKER_FILES)
    assert mirror.push() == 2
    assert mirror.push() == 0
    (folder / "a.txt").write_text("three!")
    assert mirror.push() == 1
    assert sorted(bucket_keys(s3_env, "lab", "m1/")) == ["m1/a.txt", "m1/sub/b.txt"]
    body = s3_client(s3_env).get_object(Bucket="lab", Key="m1/a.txt")["Body"].read()
    assert body == b"three!"


def test_pull_subdirs_has_and_remove_against_the_bucket(s3_env, tmp_path):
    client = s3_client(s3_env)
    for key in ("p/2024-a/tune/state.json", "p/2024-a/tune/t1/checkpoint_000001/state.pt", "p/2024-a/study.json", "p/2024-b/study.json"):
        client.put_object(Bucket="lab", Key=key, Body=key.encode())
    where = storage.Location("s3://lab/p")
    assert where.subdirs() == ["2024-a", "2024-b"]
    assert where.child("2024-a").has("tune") and not where.child("2024-b").has("tune")
    study = where.child("2024-a")
    stale = study.local / "tune" / "old.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("stale")
    assert study.pull(exclude=("checkpoint_*",), fresh=True) == 2
    assert sorted(p.relative_to(study.local).as_posix() for p in study.local.rglob("*") if p.is_file()) == ["study.json", "tune/state.json"]
    assert (study.local / "study.json").read_text() == "p/2024-a/study.json"
    assert where.pull(include=("study.json",)) == 2
    study.remove("study.json")
    assert not (study.local / "study.json").exists() and not study.has("study.json")


def test_check_writes_a_probe_and_names_the_key_for_a_missing_bucket(s3_env):
    storage.check("s3://lab/runs")
    assert not [k for k in bucket_keys(s3_env, "lab", "runs/") if "probe" in k]
    with pytest.raises(ConfigError) as err:
        storage.check("s3://nope/runs")
    assert str(err.value).startswith("tracking.storage_path s3://nope/runs: not writable (")


def test_fetch_downloads_a_file_and_names_a_missing_one(s3_env, tmp_path):
    s3_client(s3_env).put_object(Bucket="lab", Key="f/model.pt", Body=b"weights")
    local = storage.fetch("s3://lab/f/model.pt", key="checkpoint")
    assert local.read_bytes() == b"weights" and local == tmp_path / "stage" / "s3" / "lab" / "f" / "model.pt"
    with pytest.raises(ConfigError, match=r"^checkpoint s3://lab/f/missing.pt: cannot be read"):
        storage.fetch("s3://lab/f/missing.pt", key="checkpoint")


def test_search_on_a_missing_bucket_is_one_line_exit_2_nothing_recorded(s3_env, tiny_root, tmp_path, capsys):
    path = tiny_spec(tmp_path, tiny_root, name="nobucket")
    spec = yaml.safe_load(path.read_text())
    spec["overrides"]["tracking.storage_path"] = "s3://missing-bucket/studies"
    path.write_text(yaml.safe_dump(spec))
    assert main(["search", str(path)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].count("tracking.storage_path s3://missing-bucket/studies: not writable") == 1, err
    assert not (tmp_path / "mlflow.db").exists()


def test_write_file_replaces_a_local_file_whole_and_uploads_a_remote_one(s3_env, tmp_path):
    local = tmp_path / "out" / "table.md"
    assert storage.write_file(str(local), "--out", lambda tmp: tmp.write_text("new")) == local
    assert local.read_text() == "new"

    def broken(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        storage.write_file(str(local), "--out", broken)
    assert local.read_text() == "new" and sorted(p.name for p in local.parent.iterdir()) == ["table.md"]  # no temporary
    staged = storage.write_file("s3://lab/reports/table.md", "--out", lambda tmp: tmp.write_text("remote"))
    assert staged == tmp_path / "stage" / "s3" / "lab" / "reports" / "table.md" and staged.read_text() == "remote"
    body = s3_client(s3_env).get_object(Bucket="lab", Key="reports/table.md")["Body"].read()
    assert body == b"remote"


def test_mirror_never_pushes_a_file_being_written(s3_env, tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "a.txt").write_text("one")
    (folder / ".best_model.pt.0123abcd.part").write_bytes(b"half")  # replace_atomically's temporary
    assert storage.Mirror(folder, "s3://lab/m2").push() == 1
    assert bucket_keys(s3_env, "lab", "m2/") == ["m2/a.txt"]


def test_a_pull_refuses_an_object_whose_key_leaves_the_folder(s3_env, tmp_path):
    client = s3_client(s3_env)
    client.put_object(Bucket="lab", Key="run/files/best_model.pt", Body=b"ok")
    client.put_object(Bucket="lab", Key="run/files/../../escaped/evil.pth", Body=b"import os\n")
    keys = bucket_keys(s3_env, "lab", "run/")
    assert "run/files/../../escaped/evil.pth" in keys  # the store kept the key as written
    location = storage.Location("s3://lab/run/files")
    with pytest.raises(ConfigError, match=r"s3://lab/run/files: refusing to download the object .*evil\.pth"):
        location.pull()
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert not any("evil" in name for name in written), written


def test_unsafe_object_keys_are_told_apart_from_plain_ones():
    from prvrlab.files import leaves_folder

    for key in ("../x", "a/../b", "a/./b", "a//b", "/abs", "", "a/"):
        assert leaves_folder(key), key
    for key in ("a", "a/b.pt", "trials/t1/..hidden", "x..y/z"):
        assert not leaves_folder(key), key
