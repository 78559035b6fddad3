"""The ``prvrlab`` command line.

Every command validates its input first and ends with one clear message and a
non-zero exit on bad input (missing or corrupt files, invalid configs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import signal
import sys
from pathlib import Path

from prvrlab import __version__
from typing import Any, Sequence

from prvrlab.uris import redact_credentials  # standard library only: `prvrlab --help` stays light

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1

DESCRIPTION = (
    "prvrlab: train, tune, ablate and evaluate Partially Relevant Video Retrieval models "
    "(PyTorch, Ray, MLflow), and check the video/query feature collections they read."
)
EPILOG = """examples:
  prvrlab data synth --preset small --out data/synth        write the synthetic collection the configs read
  prvrlab data inspect --root data --collection tvr         check data/tvr/ as released (FeatureData/, TextData/)
  prvrlab train configs/x.yaml --set train.lr=1e-4          train one config (tracked in MLflow)
  prvrlab search search_spaces/x.yaml                       run a hyperparameter search on Ray Tune
  prvrlab eval results/<run>/files --split test             evaluate a run's best model on a split
  prvrlab report --spec search_spaces/x.yaml                write the report of the latest study

Bad input (missing or corrupt files, invalid configs) ends with one line and exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, with arguments no option takes refused by the (sub)command they follow
    (argparse's own error names the top-level parser: ``prvrlab: error``, ``see prvrlab --help``)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = parser
        while True:  # down to the innermost command chosen
            chooser = next((a for a in command._actions if isinstance(a, argparse._SubParsersAction)), None)
            chosen = chooser.choices.get(getattr(args, chooser.dest, None)) if chooser is not None else None
            if chosen is None:
                break
            command = chosen
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def seed_value(text: str) -> int:
    """argparse type of a resampling seed: an integer in [0, 2**32) (what NumPy and Optuna's importances take;
    -1 had ended report and compare in a traceback)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**32), got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type of counts and sizes: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def torch_device(text: str) -> str:
    """argparse type of --device: a device torch knows and has here (cuda needs a GPU torch sees)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: torch sees no CUDA device here; use cpu")
    return text


def _overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """The ``--set`` pairs in order; a key given twice is refused (which one was meant is not known)."""
    from prvrlab.platform.config import ConfigError, parse_override

    overrides: dict[str, Any] = {}
    given: dict[str, str] = {}
    for pair in pairs:
        key, value = parse_override(pair)
        text = pair.split("=", 1)[1].strip()
        if key in overrides:
            raise ConfigError(f"--set {key}: given twice ({given[key]}, then {text}); give each key once")
        overrides[key], given[key] = value, text
    return overrides


def _staged_file(value: str, key: str) -> Path:
    """Where a command writes its output file ``value``, checked first (one line naming ``key``): the local path
    (a ``file://`` URI's too), or for ``s3://`` / ``gs://`` a copy in the staging folder that
    :func:`storage.put` uploads once it is whole."""
    from prvrlab.platform import storage

    storage.check_file(value, key)
    uri = storage.normalize(value, key=key)
    return storage.Location(uri).local if storage.is_remote(uri) else Path(uri)


def _local_folder(value: str, key: str) -> Path:
    """The local folder ``value`` names (a ``file://`` URI's path); an object-store URI is refused naming ``key``:
    the command writes many files to local disk (it had made a folder named ``s3:`` or ``file:`` here)."""
    from prvrlab.platform import storage
    from prvrlab.platform.config import ConfigError

    uri = storage.normalize(value, key=key)
    if storage.is_remote(uri):
        raise ConfigError(f"{key} {value}: an object-store folder; this command writes a local folder "
                          "(give a local path, then copy the folder up)")
    return Path(uri)


def cmd_train(args: argparse.Namespace) -> int:
    from prvrlab.evaluation.metrics import METRIC_KEYS
    from prvrlab.platform.config import load_config
    from prvrlab.platform.train.driver import train
    from prvrlab.reports.tables import recall_text

    cfg = load_config(args.config, _overrides(args.set), preset=args.preset)
    if args.check:
        print(cfg.to_yaml(), end="")
        return 0
    result = train(cfg, use_ray=not args.no_ray)
    metrics = {k: v for k, v in result.final_metrics.items() if k != "kind"}
    print(f"best val SumR {result.best_sumr:.1f} at epoch {result.best_epoch}; run {result.run_id}")
    for split in ("val", "test"):
        if f"{split}/sumr" in metrics:
            print(f"  {split:<5} " + recall_text({k: metrics.get(f"{split}/{k}") for k in METRIC_KEYS}))
    for line in _published_lines(cfg.published, metrics, cfg.data.collection):
        print(f"  {line}")
    print(f"  files: {result.run_dir}")
    return 0


def _published_lines(published, final: dict[str, float], collection: str) -> list[str]:
    """The published result and the run's difference to it, when ``final`` has its split (a note instead
    when the run read another collection than the published one)."""
    from prvrlab.reports.tables import recall_text

    given = published.metrics()
    split = published.split
    if published.other_collection(collection) and f"{split}/sumr" in final:
        return [f"published ({published.source}; {split}) is for collection '{published.collection}', "
                f"this run read '{collection}': not compared"]
    deltas = published.compare(final, collection=collection)
    if not deltas:
        return []
    return [
        f"published ({published.source}; {split}): {recall_text(given)}",
        f"this run - published:  {recall_text({k: deltas[f'{split}/{k}_vs_published'] for k in given}, signed=True)}",
    ]


def _resume_command(command: str, args: argparse.Namespace) -> str:
    """The command that continues an interrupted study: its spec and ``--set`` as given (a resume without them
    is another spec, which is refused), then ``--resume``."""
    import shlex

    sets = " ".join(f"--set {shlex.quote(pair)}" for pair in args.set)
    return f"prvrlab {command} {shlex.quote(str(args.spec))} {sets + ' ' if sets else ''}--resume"


def _check_resume(spec, kind: str) -> None:
    """``--check --resume``: name the submission the resume would continue, or fail as it would."""
    from prvrlab.platform.search.study import check_resume

    study_dir = check_resume(spec, kind, echo=lambda line: print(line, file=sys.stderr))
    print(f"--resume would continue {kind} '{spec.name}' from {study_dir}")


def cmd_search(args: argparse.Namespace) -> int:
    from prvrlab.platform.search.spec import load_search_spec

    spec = load_search_spec(args.spec, _overrides(args.set))  # before Ray Tune's import (2 s): a bad spec fails fast
    if args.check:
        from prvrlab.platform.search.study import check_cluster  # Ray Tune's import: after the spec's check

        check_cluster(spec)
        print(f"{args.spec}: valid search spec ({len(spec.space)} keys, {spec.trials} trials)")
        if args.resume:
            _check_resume(spec, "search")
        return 0
    from prvrlab.platform.search.tuning import search

    result = search(spec, resume=args.resume)
    c = result.counts
    print(
        f"search '{spec.name}': {c['finished']} finished, {c['early_stopped']} early-stopped, "
        f"{c['failed']} failed, {c['unfinished']} unfinished; MLflow parent run {result.parent_run_id}"
    )
    if result.best is not None:
        print(f"best trial {result.best['trial_id']}: {spec.metric} {result.best['value']:.2f}")
        for key, value in result.best["config"].items():
            print(f"  {key}: {value!r}")
        print(f"best config written to {result.best['path']}  (prvrlab train {result.best['path']})")
    if result.interrupted:
        print(f"interrupted: continue with  {_resume_command('search', args)}", file=sys.stderr)
        return 130
    return 0 if result.best is not None else EXIT_FAILED


def cmd_ablate(args: argparse.Namespace) -> int:
    from prvrlab.platform.search.spec import load_ablation_spec

    spec = load_ablation_spec(args.spec, _overrides(args.set))  # before Ray Tune's import, as in cmd_search
    if args.check:
        from prvrlab.platform.search.study import check_cluster  # Ray Tune's import: after the spec's check

        check_cluster(spec)
        print(f"{args.spec}: valid ablation spec ({len(spec.variants)} variants x {len(spec.seeds)} seeds)")
        if args.resume:
            _check_resume(spec, "ablation")
        return 0
    from prvrlab.platform.search.ablation import ablate

    result = ablate(spec, resume=args.resume)
    c = result.counts
    print(
        f"ablation '{spec.name}': {c['finished']} cells finished, {c['failed']} failed, {c['missing']} missing; "
        f"MLflow parent run {result.parent_run_id}"
    )
    if result.interrupted:
        print(f"interrupted: continue with  {_resume_command('ablate', args)}", file=sys.stderr)
        return 130
    return 0 if c["failed"] == 0 and c["missing"] == 0 else EXIT_FAILED


def cmd_eval(args: argparse.Namespace) -> int:
    from prvrlab.evaluation.metrics import METRIC_KEYS
    from prvrlab.platform import storage
    from prvrlab.platform.train.checkpoint_eval import (
        check_own_data,
        checkpoint_config,
        checkpoint_epoch,
        evaluate_checkpoint,
        load_checkpoint,
    )
    from prvrlab.reports.tables import recall_text

    checkpoint = storage.fetch(args.checkpoint, key="checkpoint")  # s3:// or gs://: a staged local copy
    blob = load_checkpoint(checkpoint, config=args.config)
    if "config_file" in blob:  # a recovery checkpoint: say whose config its weights are evaluated with
        print(f"recovery checkpoint evaluated with the config {blob['config_file']}")
    if args.data_root is not None:
        _check_data_root(args.data_root, checkpoint_config(blob, checkpoint).data)
    else:
        check_own_data(checkpoint_config(blob, checkpoint), checkpoint)
    ranks = _staged_file(args.ranks, "--ranks") if args.ranks else None
    result = evaluate_checkpoint(
        checkpoint, split=args.split, data_root=args.data_root, ranks_out=None if ranks is None else str(ranks), amp=args.amp,
        device=args.device, blob=blob,
    )
    if ranks is not None:
        storage.put(ranks, storage.normalize(args.ranks, key="--ranks"))  # s3:// or gs://: upload the staged file
    m = result.metrics
    epoch = checkpoint_epoch(blob)
    print(
        (f"model of epoch {epoch}  " if epoch is not None else "")
        + f"{args.split}: {result.num_queries} queries x {result.num_videos} videos  "
        + recall_text({k: m[k] for k in METRIC_KEYS})
    )
    for group, values in (result.by_group or {}).items():
        print(f"  {group:<7} ({int(values.get('count', 0))} queries)  SumR {values['sumr']:.1f}")
    trained = checkpoint_config(blob, checkpoint)
    for line in _published_lines(trained.published, {f"{args.split}/{k}": v for k, v in m.items()}, trained.data.collection):
        print(f"  {line}")
    if args.json:
        print(json.dumps({"metrics": m, "by_group": result.by_group}, indent=1))
    return 0


def _check_data_root(value: str, data) -> None:
    """``eval --data-root`` names a folder that exists (eval never writes a collection there) and, where the
    model was trained on a synthetic collection, holds that one (:func:`~prvrlab.data.collection.check_synthetic_root`)."""
    from prvrlab.data.collection import check_synthetic_root, collection_root
    from prvrlab.platform.config import ConfigError

    path = Path(value)
    if path.is_dir():
        given = dataclasses.replace(data, root=str(path.resolve()))
        check_synthetic_root(given, collection_root(given), option="--data-root")
        return
    if path.exists():
        raise ConfigError(f"--data-root {value}: not a folder; give the folder that holds the collection")
    how = (f"; write the model's synthetic collection there with  prvrlab data synth --preset {data.synthesize} "
           f"--seed {data.synth_seed} --out {value}" if data.synthesize else "")
    raise ConfigError(f"--data-root {value}: folder not found{how}")


def _tracking_key(args: argparse.Namespace) -> str:
    """Where a report or compare command's tracking URI came from, for its errors."""
    import os

    return "--tracking-uri" if args.tracking_uri else "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "tracking store"


def _spec_study(path: Path, tracking_uri: str | None) -> tuple[str, str, str]:
    """(tracking URI, experiment, study name) of the study a search / ablation spec file describes."""
    from prvrlab.platform.config import ConfigError, read_yaml
    from prvrlab.platform.runtime import resolve_config_paths
    from prvrlab.platform.search.spec import load_ablation_spec, load_search_spec
    from prvrlab.platform.tracking.store import check_server
    from prvrlab.platform.tracking.uri import resolve_tracking_uri

    if not path.is_file():
        raise ConfigError(f"unknown spec '{path}': file not found")
    try:
        raw = read_yaml(path) or {}
        loader = load_ablation_spec if isinstance(raw, dict) and "variants" in raw else load_search_spec
        spec = loader(path)
    except ConfigError as exc:
        raise ConfigError(f"spec '{path}' cannot be read: {exc}") from None
    base = resolve_config_paths(spec.base)
    if tracking_uri:
        uri = check_server(resolve_tracking_uri(tracking_uri, key="--tracking-uri"), "--tracking-uri")
    else:
        uri = check_server(base.tracking.uri, f"spec '{path}': tracking.uri")
    return uri, base.tracking.experiment, spec.name


def _report_parent(args: argparse.Namespace) -> tuple[str, str]:
    """(tracking URI, parent run id) of the study named by --run-id, --experiment or --spec."""
    from prvrlab.platform.tracking.store import check_server
    from prvrlab.platform.tracking.uri import resolve_tracking_uri
    from prvrlab.reports.errors import ReportError
    from prvrlab.reports.source import find_parent

    if args.spec is None:
        uri = check_server(resolve_tracking_uri(args.tracking_uri, key="--tracking-uri"), _tracking_key(args))
        return uri, find_parent(tracking_uri=uri, run_id=args.run_id, experiment=args.experiment)
    path = Path(args.spec)
    uri, experiment, name = _spec_study(path, args.tracking_uri)
    try:
        return uri, find_parent(tracking_uri=uri, experiment=experiment, study=name)
    except ReportError as exc:
        raise ReportError(f"spec '{path}': {exc}") from None


def cmd_report(args: argparse.Namespace) -> int:
    from prvrlab.platform import storage
    from prvrlab.platform.config import validate
    from prvrlab.reports.report import Options, report, written_text

    if args.gallery and not args.profile:
        from prvrlab.platform.config import ConfigError

        raise ConfigError("--gallery: sizes the efficiency section, which only --profile writes; add --profile")
    measure = None
    if args.profile:  # builds models: imported only when asked for
        from prvrlab.evaluation.profile import profile_config as measure
    uri, parent = _report_parent(args)
    if args.run_id and parent != args.run_id:  # a trial's run: its study is reported
        print(f"run {args.run_id} is a trial of the study of parent run {parent}: reporting that study")
    out = _local_folder(args.out, "--out") if args.out else None
    if out is not None:
        storage.check(str(out), "--out", create=False)
    options = Options(
        split=args.split, n_boot=args.bootstrap, seed=args.seed, profile=args.profile,
        galleries=tuple(args.gallery) if args.gallery else None, read_config=validate, measure=measure,
        adjust=args.adjust,
    )
    path = report(tracking_uri=uri, parent_id=parent, out=out, options=options, log_artifact=not args.no_log)
    print(f"wrote {written_text(path)}; " + ("not logged" if args.no_log else f"logged as artifact report/ of run {parent}"))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from prvrlab.platform import storage
    from prvrlab.platform.tracking.store import check_server
    from prvrlab.platform.tracking.uri import resolve_tracking_uri
    from prvrlab.reports.compare import compare_runs

    if args.out:
        storage.check_file(args.out, "--out")
    uri = check_server(resolve_tracking_uri(args.tracking_uri, key="--tracking-uri"), _tracking_key(args))
    text = compare_runs(uri, args.run_ids, split=args.split,
                        n_boot=args.bootstrap, seed=args.seed, adjust=args.adjust)
    if args.latex:
        from prvrlab.reports.latex import latex_tables

        text = latex_tables(text, source=f"prvrlab compare {' '.join(args.run_ids)} (bootstrap {args.bootstrap}, seed {args.seed})")
    if args.out:
        storage.write_file(args.out, "--out", lambda tmp: tmp.write_text(text))
    print(text, end="")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from prvrlab.platform.config import load_config
    from prvrlab.platform.runtime import resolve_config_paths
    from prvrlab.evaluation.profile import DEFAULT_GALLERIES, profile_config
    from prvrlab.reports.profile import profile_table

    cfg = resolve_config_paths(load_config(args.config, _overrides(args.set)))
    result = profile_config(
        cfg, galleries=args.gallery or DEFAULT_GALLERIES, queries=args.queries, video_dim=args.video_dim,
        query_dim=args.query_dim, device=args.device,
    )
    print(profile_table([result]), end="")
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    from prvrlab.platform.config import ConfigError
    from prvrlab.platform.recipes import catalogue, recipes

    folder = Path(args.dir)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--dir {folder}: not a folder")
    if not recipes(folder):  # (a missing folder: its own error)
        raise ConfigError(f"--dir {folder}: no configs (*.yaml) in it")
    print(catalogue(folder), end="")
    return 0


def cmd_data_synth(args: argparse.Namespace) -> int:
    from prvrlab.data.synth import synthesize
    from prvrlab.platform import storage

    out = _local_folder(args.out, "--out")
    storage.check(str(out), "--out", create=False)
    path = synthesize(out, preset=args.preset, seed=args.seed, progress=not args.quiet)
    print(f"wrote synthetic collection '{args.preset}' to {path}")
    return 0


def cmd_data_convert(args: argparse.Namespace) -> int:
    from prvrlab.checks import first_line
    from prvrlab.data.convert import convert_bigfile, destination_problem
    from prvrlab.platform import storage
    from prvrlab.platform.config import ConfigError

    dst = storage.normalize(args.dst, key="dst")  # a file:// URI: its local path
    problem = destination_problem(args.src, dst)  # before check_file: it would only call the source a folder
    if problem:
        raise ConfigError(f"dst {args.dst}: {problem}")
    local = _staged_file(dst, "dst")
    convert_bigfile(Path(args.src), local, progress=not args.quiet)
    if storage.is_remote(dst):  # upload the staged file, then drop it (a release's features: gigabytes)
        try:
            storage.put(local, dst)
        except Exception as exc:  # pyarrow raises OSError or ArrowException subclasses
            raise ConfigError(f"dst {args.dst}: cannot be written ({first_line(exc)})") from None
        finally:
            local.unlink(missing_ok=True)
    print(f"wrote {dst}")
    return 0


def cmd_data_timestamps(args: argparse.Namespace) -> int:
    from prvrlab.data.collection import collection_root
    from prvrlab.data.config import DataConfig
    from prvrlab.data.errors import DataError
    from prvrlab.data.moments import match_moments, read_annotations
    from prvrlab.data.text import caption_path, missing_split_message, read_captions, timestamps_path, write_timestamps

    text_dir = collection_root(DataConfig(root=args.root, collection=args.collection)) / "TextData"
    captions_file = caption_path(text_dir, args.collection, args.split)
    if not captions_file.is_file():
        raise DataError(missing_split_message(text_dir, args.collection, args.split))
    captions = read_captions(captions_file)
    matched = match_moments(captions, read_annotations(args.annotations, args.format, durations=args.durations))
    if not matched.moments:
        raise DataError(f"{args.annotations}: no caption of {captions_file} matched a {args.format} annotation by video "
                        "and sentence; check --format and that the file annotates this split")
    out = timestamps_path(text_dir, args.collection, args.split)
    write_timestamps(out, matched.moments)
    left = matched.unmatched
    over = sum(end > duration for _, end, duration in matched.moments.values())
    print(f"wrote {out}: moments of {len(matched.moments):,} of {len(captions):,} captions"
          + (f"; {len(left):,} without one (e.g. {', '.join(left[:3])}): their ratio group is unknown" if left else "")
          + (f"; {over:,} ending after their video's length (ratio taken as 1)" if over else ""))
    return 0


def cmd_data_inspect(args: argparse.Namespace) -> int:
    from prvrlab.data.inspect import inspect_collection
    from prvrlab.data.config import DataConfig
    from prvrlab.data.collection import collection_root, visual_feature_of
    from prvrlab.data.text import caption_splits
    from prvrlab.platform.config import ConfigError, load_config

    splits = None
    given = [f"--{name.replace('_', '-')}" for name in ("root", "collection", "visual_feature", "text_feature")
             if getattr(args, name) is not None]
    if args.config and given:  # they had been ignored silently
        raise ConfigError(f"{given[0]}: not used with --config, which names the data; override it with --set data.<key>=...")
    if args.set and not args.config:
        raise ConfigError("--set: overrides the config --config names; without --config use --root, --collection, ...")
    if args.config:
        data = load_config(args.config, _overrides(args.set)).data
    else:
        data = DataConfig(
            root=args.root or "data/synth",
            collection=args.collection or "synth",
            visual_feature=args.visual_feature,
            text_feature=args.text_feature,
        )
        root = collection_root(data)
        if root.exists() and not root.is_dir():
            raise ConfigError(f"--root {data.root}: {root} is not a folder")
        if not root.is_dir():
            synth = f" (prvrlab data synth --out {data.root} writes a synthetic collection there)" if data.collection == "synth" else ""
            raise ConfigError(f"--root {data.root}: not found: {root}{synth}")
        if not (root / "TextData").is_dir() and not (root / data.collection).exists():
            raise ConfigError(f"--root {data.root}: holds no collection '{data.collection}' (neither {root / 'TextData'} "
                              f"nor {root / data.collection}/ exists)")
        if args.visual_feature is None:
            visual_feature_of(data, root, key="--visual-feature")  # none or several stores: name the option to pass
        splits = caption_splits(root / "TextData", data.collection) or None
    report = inspect_collection(data, splits=splits)
    print(report.format())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="prvrlab", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train one config with Ray Train (DDP) and log it to MLflow")
    p.add_argument("config", help="experiment YAML (see configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override, repeatable")
    p.add_argument("--check", action="store_true", help="validate and print the resolved config, train nothing")
    p.add_argument(
        "--preset",
        metavar="NAME",
        help="apply a named set of behaviour switches before --set, e.g. 'corrected': prvrlab's corrections "
        "of the official recipe (docs/parity.md)",
    )
    p.add_argument("--no-ray", action="store_true", help="train in this process without Ray (one worker)")
    p.set_defaults(func=cmd_train)

    for name, func, what in (("search", cmd_search, "a hyperparameter search"), ("ablate", cmd_ablate, "an ablation study")):
        p = sub.add_parser(name, help=f"run {what} on Ray Tune (one DDP training run per trial), tracked in MLflow")
        p.add_argument("spec", help=f"the {'ablation' if name == 'ablate' else name} spec YAML (see search_spaces/)")
        p.add_argument("--resume", action="store_true", help="continue the latest interrupted submission of this spec")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override of the base config, repeatable")
        p.add_argument("--check", action="store_true",
                       help="validate the spec (and with --resume, what it would continue); run nothing")
        p.set_defaults(func=func)

    p = sub.add_parser("eval", help="evaluate a saved model (best_model.pt, or a recovery checkpoint) on a split")
    p.add_argument("checkpoint", help="best_model.pt written by a training run, or a recovery checkpoint (state.pt or its checkpoint_* folder)")
    p.add_argument("--config", default=None,
                   help="the run's config.yaml, for a recovery checkpoint outside the layout training writes (it holds no config)")
    p.add_argument("--device", type=torch_device, default=None, help="cpu or cuda (default: cuda when train.use_gpu and available)")
    p.add_argument("--split", default="test", help="split to evaluate, e.g. val or test (default test)")
    p.add_argument("--data-root", default=None, help="use features from this existing folder instead of the run's data.root")
    p.add_argument("--ranks", default=None, help="write per-query ranks to this Parquet file (a path, s3:// or gs://)")
    p.add_argument("--amp", choices=["none", "bf16"], default="none", help="autocast precision of the forward pass (default none)")
    p.add_argument("--json", action="store_true", help="also print the metrics as JSON")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("report", help="write the report of a search or ablation from MLflow: report.md (tables, statistics, figures) and its tables in LaTeX (tables.tex)")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--run-id", default=None, help="the study's parent run id (a trial's run id reports its study)")
    who.add_argument("--experiment", default=None, help="an MLflow experiment: its latest search/ablation")
    who.add_argument("--spec", default=None, help="a search/ablation spec: the latest study of that name")
    p.add_argument("--out", default=None, help="output folder (default results/reports/<study name>)")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the spec's, else $MLFLOW_TRACKING_URI or ./mlflow.db)")
    p.add_argument("--split", default=None, help="split of the final metrics and ranks (default: test when logged, else val)")
    p.add_argument("--bootstrap", type=positive_int, default=1000, metavar="N", help="bootstrap / permutation resamples (default 1000)")
    p.add_argument("--seed", type=seed_value, default=0, help="seed of the resampling and importances (default 0)")
    p.add_argument("--adjust", choices=["holm", "none"], default="holm",
                   help="adjust a table's p-values for its number of comparisons (default holm: Holm-Bonferroni)")
    p.add_argument("--profile", action="store_true", help="add an efficiency table (prvrlab profile of each variant's config)")
    p.add_argument("--gallery", type=positive_int, nargs="+", default=None, help="gallery sizes for --profile (default 500 to 2500 by 500)")
    p.add_argument("--no-log", action="store_true", help="do not log the report as an artifact of the parent run")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("compare", help="runs side by side on one split: R@K, ΔSumR against the first, query-level significance")
    p.add_argument("run_ids", nargs="+", metavar="RUN_ID",
                   help="two or more MLflow run ids of training runs; the first is the reference")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default $MLFLOW_TRACKING_URI or ./mlflow.db)")
    p.add_argument("--split", default=None, help="split of the final metrics and ranks (default: test when every run logged it, else val)")
    p.add_argument("--bootstrap", type=positive_int, default=1000, metavar="N", help="bootstrap / permutation resamples (default 1000)")
    p.add_argument("--seed", type=seed_value, default=0, help="seed of the resampling (default 0)")
    p.add_argument("--adjust", choices=["holm", "none"], default="holm", help="adjust the p-values over the table's comparisons (default holm)")
    p.add_argument("--latex", action="store_true", help="print (and --out write) the table in LaTeX (booktabs), its legend as a comment")
    p.add_argument("--out", default=None, help="also write the markdown (with --latex: the LaTeX) to this file")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("profile", help="parameters, FLOPs, ms per query at several gallery sizes and memory of a config's model")
    p.add_argument("config", help="experiment YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override, repeatable")
    p.add_argument("--gallery", type=positive_int, nargs="+", default=None, help="gallery sizes in videos (default 500 to 2500 by 500)")
    p.add_argument("--queries", type=positive_int, default=20, help="single-query runs timed per gallery size (median; default 20)")
    p.add_argument("--video-dim", type=positive_int, default=None, help="video feature size (default: read from the data, else the small synthetic preset's)")
    p.add_argument("--query-dim", type=positive_int, default=None, help="query token feature size (default: read from the data, else the small synthetic preset's)")
    p.add_argument("--device", type=torch_device, default=None, help="cpu or cuda (default: cuda when train.use_gpu and available)")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("recipes", help="the shipped configs by dataset: official / paper / synthetic, the published number")
    p.add_argument("--dir", default="configs", help="folder of experiment YAMLs (default configs, in the folder you run from)")
    p.set_defaults(func=cmd_recipes)

    data = sub.add_parser("data", help="synthetic data, conversion and checks").add_subparsers(dest="data_cmd", required=True)
    p = data.add_parser("synth", help="write a synthetic PRVR collection in the public release layout")
    p.add_argument("--out", default="data/synth", help="output folder (default data/synth)")
    p.add_argument("--preset", default="small",
                   help="size preset: tiny, small, medium or tvr, each also as <name>-skewed (skewed: small-skewed) (default small)")
    p.add_argument("--seed", type=seed_value, default=0, help="random seed (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_data_synth)

    p = data.add_parser("convert", help="convert a BigFile feature folder to one HDF5 file")
    p.add_argument("src", help="BigFile folder (feature.bin, shape.txt, id.txt, video2frames.txt)")
    p.add_argument("dst", help="output .hdf5 file (one dataset per video)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_data_convert)

    p = data.add_parser(
        "timestamps", help="write a split's moment timestamps (for R@K by moment/video ratio) from the dataset's annotations"
    )
    p.add_argument("annotations", help="TVR's tvr_<split>_release.jsonl, ActivityNet Captions' <split>.json or Charades-STA's charades_sta_<split>.txt")
    p.add_argument("--format", required=True, choices=("tvr", "activitynet", "charades"), help="which dataset's annotation file it is")
    p.add_argument("--root", required=True, help="folder holding the collection's TextData/, or its parent")
    p.add_argument("--collection", required=True, help="collection name, the caption file prefix (tvr, activitynet, charades)")
    p.add_argument("--split", required=True, help="the caption file's split (<collection><split>.caption.txt)")
    p.add_argument("--durations", default=None, help="Charades-STA: Charades' Charades_v1_<split>.csv (video lengths)")
    p.set_defaults(func=cmd_data_timestamps)

    p = data.add_parser("inspect", help="summarise and check a collection")
    p.add_argument("--config", default=None, help="take the data section of this experiment config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override of --config, repeatable")
    p.add_argument("--root", default=None, help="folder holding FeatureData/ and TextData/, or its parent (default data/synth)")
    p.add_argument("--collection", default=None, help="collection name, the caption file prefix (default synth)")
    p.add_argument(
        "--visual-feature", default=None, help="FeatureData/ BigFile folder or .hdf5 file (default: the only one there)"
    )
    p.add_argument("--text-feature", default=None, help="query feature file (default TextData/roberta_<collection>_query_feat.hdf5)")
    p.set_defaults(func=cmd_data_inspect)
    for commands in (sub, data):  # errors say COMMAND (and list the choices), not the attribute holding it
        commands.metavar = "COMMAND"
    return parser


def _terminate(signum, frame) -> None:
    """SIGTERM ends a command like Ctrl-C: open MLflow runs are closed as KILLED (at once, by a
    detached process, in case this one is killed before it winds down; see tracking/closer.py)."""
    from prvrlab.platform.tracking.closer import stop_requested

    stop_requested("stopped by SIGTERM")
    raise KeyboardInterrupt


STORE_ERRORS = (("mlflow.exceptions", "MlflowException"), ("sqlalchemy.exc", "SQLAlchemyError"))


def _store_error_line(exc: Exception) -> str | None:
    """One line for an MLflow store or file-system error that reached :func:`main` (None for any other
    error, left to its traceback): its first line, after the store whose Tracker client raised it if one did."""
    from prvrlab.checks import first_line

    kinds = tuple(k for k in (getattr(sys.modules.get(m), n, None) for m, n in STORE_ERRORS) if k is not None)
    if not isinstance(exc, (OSError, *kinds)):  # the store's kinds only once loaded: never imported here
        return None
    reason = first_line(exc)
    store = sys.modules.get("prvrlab.platform.tracking.store")  # loaded once a Tracker was opened
    uri = store.store_uri(exc) if store is not None else None
    return f"MLflow store {uri}: {reason}" if uri else reason


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``prvrlab`` console script."""
    from prvrlab.data.errors import DataError
    from prvrlab.platform.config import ConfigError
    from prvrlab.platform.failures import TrainingError
    from prvrlab.platform.search.spec import StudyError
    from prvrlab.registry import RegistryError
    from prvrlab.reports.errors import ReportError

    from prvrlab.platform.tracking import closer

    args = _parse(build_parser(), argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    closer.guard_process()  # a sentinel closes this process's runs if it is killed outright
    try:
        return int(args.func(args) or 0)
    except (ConfigError, DataError, RegistryError) as exc:
        print(f"prvrlab: error: {redact_credentials(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except TrainingError as exc:
        print(f"prvrlab: training failed: {redact_credentials(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    except (StudyError, ReportError) as exc:
        print(f"prvrlab: error: {redact_credentials(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("prvrlab: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        line = _store_error_line(exc)
        if line is None:
            raise
        if isinstance(exc, BrokenPipeError):  # stdout's reader went away (| head): its pending output goes nowhere
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"prvrlab: error: {redact_credentials(line)}", file=sys.stderr)
        return EXIT_FAILED
    finally:  # a process that goes on (tests, notebooks) gets its handler back and no more sentinels
        closer.unguard_process()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def run() -> None:
    """The ``prvrlab`` console script: :func:`main`, then exit without the interpreter's last garbage
    collections.  With torch, MLflow and Ray loaded they walk millions of objects at exit (1.3 of the
    1.6 s a finished command took to exit here); frozen objects are skipped.  Exit handlers (Ray's
    shutdown, logging) still run, and whatever they create is collected as usual.  Ray, where the command
    started or joined it, is shut down here rather than by its exit handler, which first sleeps 0.5 s for
    worker logs to reach the terminal (this CLI does not stream them: ``log_to_driver=False``)."""
    code = main()
    _shutdown_ray()
    gc.freeze()
    sys.exit(code)


def _shutdown_ray() -> None:
    """``ray.shutdown()`` if this process connected to Ray (an error only warns: the command has ended)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    try:
        ray.shutdown()
    except KeyboardInterrupt:  # a second Ctrl-C: Ray's exit handler finishes the shutdown
        pass
    except Exception as exc:  # noqa: BLE001 - as above
        print(f"prvrlab: warning: shutting Ray down failed: {exc}", file=sys.stderr)


if __name__ == "__main__":
    run()
