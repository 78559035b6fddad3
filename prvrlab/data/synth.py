"""Synthetic PRVR collections in the public release's on-disk layout.

:func:`synthesize` writes, under ``out_root``, a collection named ``synth``::

    FeatureData/synth_feat/{feature.bin, shape.txt, id.txt, video2frames.txt}   BigFile
    TextData/roberta_synth_query_feat.hdf5          one (n_tokens, Dq) dataset per cap_id
    TextData/synth{train,val,test}.caption.txt      "<cap_id> <caption text>" lines
    TextData/synth{train,val,test}.timestamps.json  {cap_id: [start_s, end_s, duration_s]}
    TextData/synth{train,val,test}.truth.json       what each query names and each video shows
    synth.json                                      the preset and seed used

so it is read by exactly the code that reads TVR / ActivityNet / Charades.

Generative process
------------------
Shared by the whole collection (drawn once from the seed), in a latent space
of dimension ``K``:

- ``A`` action directions ``u_a`` and ``O`` object directions ``u_o`` (random
  unit vectors), plus one pair-specific direction ``u_ao`` for every
  (action, object) pair.  The concept shown by a moment is the pair
  ``c_ao = normalize(u_a + u_o + interaction * u_ao)``: a query names the
  action and the object separately, so it is discriminative only through the
  combination, and the ``u_ao`` term is a non-linear (pair-specific) part that
  only a model that learns interactions can exploit.
- ``NB`` background directions ``b_j`` shared across all videos.
- A fixed random linear map ``P_v`` (Dv x K, near-isometric) to the visual space
  and an independent one ``P_q`` (Dq x K) to the text space, so the two
  modalities are not aligned without learning.
- A word vocabulary: each action and each object has ``words_per_concept``
  synonyms with embedding ``P_q u + synonym_noise * g`` (``g`` random, Dq);
  ``F`` function words with random embeddings, shared by all queries.

Each video (``T ~ U[frames]`` frames, ``k ~ U[queries_per_video]`` moments):

- the background is a sequence of 1-3 scenes, each a random ``b_j``;
- each moment draws an (action, object) pair uniformly and a moment/video
  ratio from a mixture: short U(0.03, 0.2] with prob. 0.45, medium
  (0.2, 0.4] with 0.3, long (0.4, 0.85] with 0.25; it covers
  ``L = max(1, round(r T))`` consecutive frames at a uniform random start
  (moments may overlap, so other videos showing the same action, object or
  pair are partially relevant);
- frame latent ``z_t = w_t b_scene(t) + sum_m c_m / sqrt(#active) + frame_noise * e_t``,
  with ``w_t = 1`` outside moments and 0.5 inside, and ``e_t ~ N(0, I/K)``;
- frame feature ``x_t = P_v z_t + visual_noise * n_t``, ``n_t ~ N(0, I/Dv)``.

Each moment gets one query: 1-2 synonym tokens of its action and 1-2 of its
object (with probability ``vague_prob`` only one of the two is named), mixed
in random order with ``function_tokens`` function words; every token feature
is its word embedding plus ``token_noise * N(0, I/Dq)``.  Query lengths
therefore vary.

``skewed=True`` reproduces a failure case of the reference code (REFERENCE
section 9): every text token gets a large common offset (norm ``4``) and the
function words are 3x stronger and more numerous.  The task stays solvable
(a linear probe that centres the features still works) but models whose
pooling collapses on the shared component fail.  Use it as a robustness test,
not as the default.

Everything is drawn from ``numpy.random.default_rng`` streams keyed by
``(seed, split, video number)``, so the output is deterministic given the seed.
Videos are streamed to disk ``chunk_videos`` at a time (memory stays bounded
for the ``tvr`` preset); caption lines are shuffled within each such block so
that a video's queries are not always adjacent in the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from tqdm import tqdm

from prvrlab.data.errors import DataError
from prvrlab.data.text import write_timestamps
from prvrlab.data.truth import truth_file_name
from prvrlab.registry import did_you_mean

COLLECTION = "synth"
VISUAL_FEATURE = "synth_feat"
SPLITS = ("train", "val", "test")
GENERATOR_VERSION = 2  # 2: adds the ground-truth files
_RATIO_GROUPS = ((0.45, 0.03, 0.2), (0.30, 0.2, 0.4), (0.25, 0.4, 0.85))  # (probability, low, high)


@dataclass(frozen=True)
class SynthPreset:
    """Sizes and difficulty of a synthetic collection (see the module docstring)."""

    name: str
    videos: tuple[int, int, int]  # train, val, test
    queries_per_video: tuple[int, int]  # inclusive range
    frames: tuple[int, int]  # inclusive range of frames per video
    video_dim: int
    query_dim: int
    latent_dim: int
    num_actions: int
    num_objects: int
    num_backgrounds: int
    words_per_concept: int = 3
    num_function_words: int = 40
    function_tokens: tuple[int, int] = (2, 10)
    interaction: float = 0.8
    frame_noise: float = 1.0
    visual_noise: float = 1.0
    synonym_noise: float = 0.5
    token_noise: float = 0.4
    vague_prob: float = 0.1
    skewed: bool = False
    seconds_per_frame: float = 1.5
    chunk_videos: int = 256


PRESETS: dict[str, SynthPreset] = {
    "tiny": SynthPreset(  # for tests: easier (less noise) so that a few steps already learn something
        name="tiny",
        videos=(96, 48, 48),
        queries_per_video=(2, 3),
        frames=(8, 60),
        video_dim=64,
        query_dim=48,
        latent_dim=16,
        num_actions=12,
        num_objects=12,
        num_backgrounds=3,
        words_per_concept=2,
        num_function_words=12,
        function_tokens=(1, 4),
        interaction=0.3,
        frame_noise=0.5,
        visual_noise=0.5,
        token_noise=0.3,
    ),
    "small": SynthPreset(
        name="small",
        videos=(600, 150, 150),
        queries_per_video=(3, 7),
        frames=(40, 200),
        video_dim=256,
        query_dim=128,
        latent_dim=64,
        num_actions=24,
        num_objects=24,
        num_backgrounds=16,
    ),
    "medium": SynthPreset(
        name="medium",
        videos=(3000, 500, 500),
        queries_per_video=(3, 7),
        frames=(40, 200),
        video_dim=512,
        query_dim=256,
        latent_dim=96,
        num_actions=48,
        num_objects=48,
        num_backgrounds=32,
    ),
    "tvr": SynthPreset(
        name="tvr",
        videos=(17435, 2179, 2179),
        queries_per_video=(5, 5),
        frames=(20, 120),
        video_dim=3072,
        query_dim=768,
        latent_dim=128,
        num_actions=64,
        num_objects=64,
        num_backgrounds=48,
        function_tokens=(3, 16),
        chunk_videos=64,
    ),
}
PRESETS["skewed"] = dataclasses.replace(PRESETS["small"], name="skewed", skewed=True)


def preset_names() -> list[str]:
    """The preset names a config may give: every preset and its ``-skewed`` variant."""
    return [*PRESETS, *(f"{name}-skewed" for name in PRESETS if name != "skewed")]


def get_preset(preset: str | SynthPreset) -> SynthPreset:
    """A preset by name (``"<name>-skewed"`` gives the skewed variant of any preset)."""
    if isinstance(preset, SynthPreset):
        return preset
    if preset in PRESETS:
        return PRESETS[preset]
    base, _, suffix = preset.rpartition("-")
    if suffix == "skewed" and base in PRESETS:
        return dataclasses.replace(PRESETS[base], name=preset, skewed=True)
    hint = did_you_mean(preset, [*PRESETS, *(f"{name}-skewed" for name in PRESETS)])
    raise DataError(f"unknown synthetic preset {preset!r}{hint}; known: {', '.join(PRESETS)} (or '<name>-skewed')")


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


class _World:
    """The structure shared by every video and query of a collection."""

    def __init__(self, p: SynthPreset, seed: int) -> None:
        rng = np.random.default_rng([seed, 0])
        k = p.latent_dim
        self.actions = _unit(rng.standard_normal((p.num_actions, k)))  # (A, K)
        self.objects = _unit(rng.standard_normal((p.num_objects, k)))  # (O, K)
        pair = _unit(rng.standard_normal((p.num_actions, p.num_objects, k)))  # (A, O, K)
        self.concepts = _unit(
            self.actions[:, None] + self.objects[None, :] + p.interaction * pair
        ).astype(np.float32)  # (A, O, K)
        self.backgrounds = _unit(rng.standard_normal((p.num_backgrounds, k))).astype(np.float32)  # (NB, K)
        self.p_video = (rng.standard_normal((p.video_dim, k)) / np.sqrt(p.video_dim)).astype(np.float32)  # (Dv, K)
        p_query = rng.standard_normal((p.query_dim, k)) / np.sqrt(p.query_dim)  # (Dq, K), near-isometric
        s = p.words_per_concept
        self.action_words = (
            (self.actions @ p_query.T)[:, None]
            + p.synonym_noise * rng.standard_normal((p.num_actions, s, p.query_dim)) / np.sqrt(p.query_dim)
        ).astype(np.float32)  # (A, S, Dq)
        self.object_words = (
            (self.objects @ p_query.T)[:, None]
            + p.synonym_noise * rng.standard_normal((p.num_objects, s, p.query_dim)) / np.sqrt(p.query_dim)
        ).astype(np.float32)  # (O, S, Dq)
        self.function_words = _unit(rng.standard_normal((p.num_function_words, p.query_dim))).astype(np.float32)
        self.offset = np.zeros(p.query_dim, dtype=np.float32)  # (Dq,)
        if p.skewed:
            self.function_words *= 3.0
            self.offset = (4.0 * _unit(rng.standard_normal(p.query_dim))).astype(np.float32)


@dataclass
class _Moment:
    start: int
    end: int
    action: int
    obj: int


def _moments(rng: np.random.Generator, p: SynthPreset, t: int) -> list[_Moment]:
    k = int(rng.integers(p.queries_per_video[0], p.queries_per_video[1] + 1))
    probs = np.array([g[0] for g in _RATIO_GROUPS])
    out = []
    for _ in range(k):
        _, lo, hi = _RATIO_GROUPS[int(rng.choice(len(_RATIO_GROUPS), p=probs))]
        length = int(np.clip(round(rng.uniform(lo, hi) * t), 1, t))
        start = int(rng.integers(0, t - length + 1))
        out.append(_Moment(start, start + length, int(rng.integers(p.num_actions)), int(rng.integers(p.num_objects))))
    return out


def _video_latent(rng: np.random.Generator, p: SynthPreset, w: _World, t: int, moments: list[_Moment]) -> np.ndarray:
    """Frame latents (T, K) of one video."""
    cuts = np.sort(rng.choice(np.arange(1, t), size=min(int(rng.integers(0, 3)), t - 1), replace=False))
    scene = np.zeros(t, dtype=np.int64)  # (T,) scene number of each frame
    scene[cuts] = 1
    scene_bg = rng.integers(p.num_backgrounds, size=len(cuts) + 1)
    active = np.zeros(t, dtype=np.float32)  # (T,) number of moments covering each frame
    content = np.zeros((t, p.latent_dim), dtype=np.float32)  # (T, K)
    for m in moments:
        content[m.start : m.end] += w.concepts[m.action, m.obj]
        active[m.start : m.end] += 1
    weight = np.where(active > 0, 0.5, 1.0).astype(np.float32)[:, None]  # (T, 1)
    z = weight * w.backgrounds[scene_bg[np.cumsum(scene)]]  # (T, K)
    z += content / np.sqrt(np.maximum(active, 1))[:, None]
    z += p.frame_noise / np.sqrt(p.latent_dim) * rng.standard_normal((t, p.latent_dim), dtype=np.float32)
    return z


def _query(rng: np.random.Generator, p: SynthPreset, w: _World, m: _Moment) -> tuple[np.ndarray, str, list[int | None]]:
    """Token features (n, Dq), caption text and named ``[action, object]`` (None: not named) of the query of ``m``."""
    name_action, name_object = True, True
    if rng.random() < p.vague_prob:
        if rng.random() < 0.5:
            name_action = False
        else:
            name_object = False
    vectors, words = [], []
    for named, table, concept, tag in (
        (name_action, w.action_words, m.action, "act"),
        (name_object, w.object_words, m.obj, "obj"),
    ):
        if named:
            syn = rng.integers(p.words_per_concept, size=1 + int(rng.random() < 0.3))
            vectors.append(table[concept, syn])
            words += [f"{tag}{concept}.{s}" for s in syn]
    n_function = int(rng.integers(p.function_tokens[0], p.function_tokens[1] + 1))
    if p.skewed:
        n_function *= 2
    fw = rng.integers(p.num_function_words, size=n_function)
    vectors.append(w.function_words[fw])
    words += [f"fw{j}" for j in fw]
    tokens = np.concatenate(vectors)  # (n, Dq)
    order = rng.permutation(len(tokens))
    noise = p.token_noise / np.sqrt(p.query_dim) * rng.standard_normal(tokens.shape, dtype=np.float32)
    tokens = tokens[order] + noise + w.offset  # (n, Dq)
    named_concept = [m.action if name_action else None, m.obj if name_object else None]
    return tokens.astype(np.float32), " ".join(words[i] for i in order), named_concept


def _write(root: Path, p: SynthPreset, seed: int, progress: bool) -> None:
    world = _World(p, seed)
    feat_dir = root / "FeatureData" / VISUAL_FEATURE
    text_dir = root / "TextData"
    feat_dir.mkdir(parents=True)
    text_dir.mkdir(parents=True)
    total_rows = 0
    bar = tqdm(total=sum(p.videos), desc=f"synth {p.name}", unit="video", disable=not progress)
    with (
        open(feat_dir / "feature.bin", "wb") as fbin,
        open(feat_dir / "id.txt", "w", encoding="latin-1") as fids,
        open(feat_dir / "video2frames.txt", "w", encoding="latin-1") as fv2f,
        h5py.File(text_dir / f"roberta_{COLLECTION}_query_feat.hdf5", "w") as fq,
    ):
        fv2f.write("{")
        sep = ""
        for split_no, (split, count) in enumerate(zip(SPLITS, p.videos)):
            stamps: dict[str, tuple[float, float, float]] = {}
            truth: dict[str, dict] = {"queries": {}, "videos": {}}
            with open(text_dir / f"{COLLECTION}{split}.caption.txt", "w", encoding="utf-8") as fcap:
                for lo in range(0, count, p.chunk_videos):
                    lines, latents, noises = [], [], []
                    for i in range(lo, min(lo + p.chunk_videos, count)):
                        rng = np.random.default_rng([seed, 1, split_no, i])
                        vid = f"{COLLECTION}_{split}_{i:05d}"
                        t = int(rng.integers(p.frames[0], p.frames[1] + 1))
                        moments = _moments(rng, p, t)
                        latents.append(_video_latent(rng, p, world, t, moments))  # (T, K)
                        noises.append(rng.standard_normal((t, p.video_dim), dtype=np.float32))  # (T, Dv)
                        total_rows += t
                        frame_ids = [f"{vid}_f{j}" for j in range(t)]
                        fids.write(" ".join(frame_ids) + "\n")
                        fv2f.write(f"{sep}{vid!r}: {frame_ids!r}")
                        sep = ", "
                        truth["videos"][vid] = [[m.action, m.obj] for m in moments]
                        for q, m in enumerate(moments):
                            cap_id = f"{vid}#{q}"
                            tokens, text, truth["queries"][cap_id] = _query(rng, p, world, m)
                            fq.create_dataset(cap_id, data=tokens)
                            lines.append(f"{cap_id} {text}\n")
                            sec = p.seconds_per_frame
                            stamps[cap_id] = (m.start * sec, m.end * sec, t * sec)
                        bar.update(1)
                    # One GEMM per chunk: many small ones are slow with a threaded BLAS on busy cores.
                    x = np.concatenate(latents) @ world.p_video.T  # (rows, Dv)
                    x += p.visual_noise / np.sqrt(p.video_dim) * np.concatenate(noises)
                    fbin.write(np.ascontiguousarray(x, dtype="<f4").tobytes())
                    # Caption lines are shuffled within each block of videos, as in
                    # the public files queries of a video need not be adjacent.
                    order = np.random.default_rng([seed, 2, split_no, lo]).permutation(len(lines))
                    fcap.writelines(lines[j] for j in order)
            write_timestamps(text_dir / f"{COLLECTION}{split}.timestamps.json", stamps)
            (text_dir / truth_file_name(COLLECTION, split)).write_text(json.dumps(truth, separators=(",", ":")) + "\n")
        fv2f.write("}\n")
    bar.close()
    (feat_dir / "shape.txt").write_text(f"{total_rows} {p.video_dim}\n")
    info = {"collection": COLLECTION, "seed": seed, "generator_version": GENERATOR_VERSION, **dataclasses.asdict(p)}
    (root / "synth.json").write_text(json.dumps(info, indent=1) + "\n")


def _staging_dir(out_root: Path) -> Path:
    out_root.parent.mkdir(parents=True, exist_ok=True)
    return out_root.parent / f".{out_root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def synthesize(out_root: str | Path, *, preset: str | SynthPreset, seed: int = 0, progress: bool = True) -> Path:
    """Write the synthetic collection ``preset`` (a name or a :class:`SynthPreset`) under ``out_root``.

    The files are written to a staging folder next to ``out_root`` and then
    moved in place, replacing an earlier synthetic collection there (other
    files in ``out_root`` are kept).  Returns ``out_root``.
    """
    p = get_preset(preset)
    if seed < 0:
        raise DataError(f"synthetic seed must be >= 0, got {seed}")
    out_root = Path(out_root)
    staging = _staging_dir(out_root)
    try:
        _write(staging, p, seed, progress)
        if not out_root.exists():
            os.rename(staging, out_root)
            return out_root
        written = [Path("FeatureData") / VISUAL_FEATURE, Path("synth.json")]
        written += [Path("TextData") / f.name for f in (staging / "TextData").iterdir()]
        for rel in written:  # nothing written or removed through a link to elsewhere
            for part in (rel, *rel.parents[:-1]):
                if (out_root / part).is_symlink():
                    raise DataError(f"{out_root / part} is a symbolic link; not replacing a synthetic collection through it")
        for rel in written:
            dst = out_root / rel
            if dst.is_dir():
                shutil.rmtree(dst)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / rel, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_root


def refresh_if_outdated(root: str | Path) -> bool:
    """Rewrite a collection written by an older generator version, with its own preset and seed.

    The features and captions come out identical (the random streams did not
    change); what is new is added (version 2: the ground-truth files).
    Returns whether it rewrote anything.
    """
    root = Path(root)
    try:
        info = json.loads((root / "synth.json").read_text(encoding="utf-8"))
        version = int(info.get("generator_version", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return False  # unreadable or not this generator's record: left to check_synthetic_root to refuse
    if version >= GENERATOR_VERSION:
        return False
    fields = {f.name for f in dataclasses.fields(SynthPreset)}
    try:
        preset = SynthPreset(**{k: tuple(v) if isinstance(v, list) else v for k, v in info.items() if k in fields})
        known = get_preset(preset.name)
    except (DataError, TypeError, ValueError):
        return False  # not a preset this generator wrote: left as it is
    if preset != known:  # sizes from the folder, not a preset's: not regenerated (they could fill the disk)
        return False
    synthesize(root, preset=known, seed=int(info["seed"]), progress=False)
    return True


def synthesize_if_missing(out_root: str | Path, *, preset: str | SynthPreset, seed: int = 0, progress: bool = False) -> Path:
    """Write ``preset`` to ``out_root`` unless it exists; safe when processes race.

    Each process writes to its own staging folder and renames it atomically
    into place; a process that loses the race discards its copy.
    """
    out_root = Path(out_root)
    if out_root.exists():
        return out_root
    p = get_preset(preset)
    staging = _staging_dir(out_root)
    try:
        _write(staging, p, seed, progress)
        try:
            os.rename(staging, out_root)
        except OSError:
            if not out_root.exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_root
