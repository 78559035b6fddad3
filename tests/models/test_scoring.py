"""max_scores (prvrlab/models/scoring.py) against hand loops: the mask, videos without a real frame,
zero vectors, negative maxima, chunking; with and without logits and autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prvrlab.models import scoring
from prvrlab.models.base import VideoEmbedding
from prvrlab.models.scoring import index_token_norms, max_scores, token_norms


# Scores of one formula computed by products of other shapes: equal up to float32 summation order
# (cosines of 6-16-d vectors: a few units in the last place).
SUM_ORDER = 1e-6


def hand_max(query, video, mask):
    out = torch.full((query.shape[0], video.shape[0]), -1.0)
    for i in range(query.shape[0]):
        for v in range(video.shape[0]):
            real = [j for j in range(video.shape[1]) if mask is None or bool(mask[v, j])]
            if real:
                out[i, v] = max(float(F.cosine_similarity(query[i], video[v, j], dim=0)) for j in real)
    return out


def test_max_scores_equal_the_hand_loop():
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(5, 6, generator=gen)
    video = torch.randn(4, 7, 6, generator=gen)
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2] = False  # no real frame: -1
    video[3] = -query[0] * torch.rand(7, 1, generator=gen)  # query 0: every frame of video 3 at cos -1
    video[0, 5:] = 0.0  # zero vectors: cos 0
    expected = hand_max(query, video, mask)
    with torch.no_grad():
        retrieval = max_scores(query, video, mask).sim
    training = max_scores(query.requires_grad_(), video, mask, with_logits=True).sim
    torch.testing.assert_close(retrieval, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(training.detach(), expected, atol=1e-6, rtol=1e-6)
    assert retrieval[:, 2].eq(-1.0).all() and abs(retrieval[0, 3].item() + 1.0) < 1e-6


def test_padding_never_wins_against_negative_scores():
    query = torch.tensor([[1.0, 0.0]])
    video = torch.tensor([[[-1.0, 0.2], [0.0, 0.0], [5.0, 5.0]]])  # real: cos -0.98; then padding
    mask = torch.tensor([[True, False, False]])
    with torch.no_grad():
        got = max_scores(query, video, mask).sim
    assert abs(got.item() - float(F.cosine_similarity(query[0], video[0, 0], dim=0))) < 1e-6


def test_chunked_retrieval_equals_one_chunk(monkeypatch):
    import prvrlab.models.scoring as scoring

    gen = torch.Generator().manual_seed(1)
    query, video = torch.randn(3, 4, generator=gen), torch.randn(6, 5, 4, generator=gen)
    mask = torch.rand(6, 5, generator=gen) > 0.3
    with torch.no_grad():
        whole = max_scores(query, video, mask).sim
        monkeypatch.setattr(scoring, "_MAX_CHUNK_ELEMENTS", 1)  # one video per chunk (autograd path)
        monkeypatch.setattr(scoring, "_RETRIEVAL_BLOCK_ELEMENTS", 1)  # one video per block (retrieval)
        chunked = max_scores(query, video, mask).sim
    torch.testing.assert_close(chunked, whole)


def gallery(nv: int = 7, length: int = 5, dim: int = 6):
    g = torch.Generator().manual_seed(0)
    video = torch.randn(nv, length, dim, generator=g)
    mask = torch.arange(length)[None] < torch.randint(1, length + 1, (nv,), generator=g)[:, None]  # (Nv, L)
    return torch.randn(4, dim, generator=g), video * mask[..., None], mask


def test_precomputed_norms_give_the_same_scores_bit_for_bit():
    query, video, mask = gallery()
    plain = max_scores(query, video, mask, with_logits=True)
    for norms in (token_norms(video), torch.cat([token_norms(video[:3]), token_norms(video[3:])])):  # chunks agree
        given = max_scores(query, video, mask, with_logits=True, video_norm=norms)
        assert torch.equal(given.sim, plain.sim) and torch.equal(given.logits, plain.logits)
    torch.testing.assert_close(plain.sim, hand_max(query, video, mask), atol=1e-6, rtol=1e-6)


def test_in_place_retrieval_equals_the_autograd_path(monkeypatch):
    """Without autograd the cosine is divided and masked in place; with it, out of place: same values
    up to float32 summation order (the two paths cut the gallery into products of different widths, and
    some CPUs' GEMMs round by width: MKL on an AMD EPYC differs in the last bit), and gradients still
    flow (chunks of one video, so several chunks run)."""
    query, video, mask = gallery()
    monkeypatch.setattr(scoring, "_MAX_CHUNK_ELEMENTS", query.shape[0] * video.shape[1])
    with torch.no_grad():
        retrieval = max_scores(query, video, mask).sim
    q = query.clone().requires_grad_(True)
    trained = max_scores(q, video, mask).sim
    trained.sum().backward()
    torch.testing.assert_close(retrieval, trained.detach(), rtol=SUM_ORDER, atol=SUM_ORDER)
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_index_token_norms_adds_each_3d_field_once():
    _, video, mask = gallery()
    emb = VideoEmbedding(clip=video, frame=video[:, 0], frame_mask=None)
    index = index_token_norms(emb, ("clip", "frame"))
    assert set(index.extra) == {"clip_norm"}  # frame is (Nv, D): nothing to index
    assert torch.equal(index.extra["clip_norm"], token_norms(video))
    assert index_token_norms(index, ("clip", "frame")) is index and "clip_norm" not in emb.extra


def masked_fill_max(query, video, mask, norms):
    """The retrieval formula written plainly: divide by both norms, fill padding with -1, take the max."""
    cos = (query @ video.reshape(-1, video.shape[-1]).t()).view(query.shape[0], *video.shape[:2])  # (Nq, Nv, L)
    cos = cos / (query.norm(dim=-1).clamp(min=1e-6)[:, None, None] * norms[None])
    return cos.masked_fill(~mask[None], -1.0).amax(dim=-1)  # (Nq, Nv)


def test_retrieval_blocks_equal_the_masked_fill_formula(monkeypatch):
    """Adding -inf to padding and flooring padded videos at -1 is the masked fill's max: the same values
    (up to float32 summation order: a block's product has another width than the formula's), in one
    block or in blocks of one video; an all-padding video scores exactly -1, a real -0.98 beats padding."""
    query, video, mask = gallery(nv=9)
    mask[2] = False
    video[2] = 0.0
    query[0] = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    video[4, 0], mask[4] = torch.tensor([-1.0, 0.2, 0.0, 0.0, 0.0, 0.0]), torch.arange(5) < 1
    norms = token_norms(video)
    expected = masked_fill_max(query, video, mask, norms)
    for block in (1 << 21, video.shape[1] * query.shape[0], 1):
        monkeypatch.setattr(scoring, "_RETRIEVAL_BLOCK_ELEMENTS", block)
        with torch.no_grad():
            got = max_scores(query, video, mask, video_norm=norms).sim
        torch.testing.assert_close(got, expected, atol=SUM_ORDER, rtol=SUM_ORDER)
    assert got[:, 2].eq(-1.0).all() and abs(got[0, 4].item() + 1 / 1.04 ** 0.5) < 1e-6


def test_bf16_gallery_scores_are_float32_sums_of_exact_products():
    """A gallery and queries holding bf16 values (bf16 autocast's outputs): index_token_norms keeps the
    field in bf16 (same values, half the memory) and retrieval scores match float64 to float32 summation
    error, with or without the CPU's bf16 units; the matmul precision setting is restored."""
    from prvrlab.models.precision import _mkldnn_matmul

    query, video, mask = gallery(nv=12, length=9, dim=64)
    query, video = query.bfloat16().float(), video.bfloat16().float()
    index = index_token_norms(VideoEmbedding(clip=video, frame=video[:, 0], frame_mask=None), ("clip",))
    assert index.clip.dtype == torch.bfloat16 and torch.equal(index.clip.float(), video)
    matmul = _mkldnn_matmul()
    before = None if matmul is None else matmul.fp32_precision
    with torch.no_grad():
        got = max_scores(query, index.clip, mask, video_norm=index.extra["clip_norm"]).sim
    assert matmul is None or matmul.fp32_precision == before
    q64, v64 = query.double(), video.double()
    cos = torch.einsum("qd,vld->qvl", q64, v64) / (q64.norm(dim=-1)[:, None, None] * v64.norm(dim=-1).clamp(min=1e-6)[None])
    expected = cos.masked_fill(~mask[None], -1.0).amax(dim=-1).float()
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=0)
    plain = index_token_norms(VideoEmbedding(clip=video + 1e-3, frame=video[:, 0], frame_mask=None), ("clip",))
    assert plain.clip.dtype == torch.float32  # not bf16 values: kept as they are


def test_bf16_products_switch_on_and_back():
    from prvrlab.models.precision import _mkldnn_matmul, bf16_exact, bf16_products, native_low_precision

    matmul = _mkldnn_matmul()
    before = None if matmul is None else matmul.fp32_precision
    with bf16_products(False) as on:
        assert on is False and (matmul is None or matmul.fp32_precision == before)
    with bf16_products() as on:
        assert on == (matmul is not None and native_low_precision("cpu"))
        assert not on or matmul.fp32_precision == "bf16"
    assert matmul is None or matmul.fp32_precision == before
    x = torch.randn(4, 3)
    assert bf16_exact(x.bfloat16()) and bf16_exact(x.bfloat16().float()) and not bf16_exact(x.bfloat16().float() + 1e-3)


def test_indexed_score_elements_count_videos_not_tokens():
    from prvrlab.models.scoring import indexed_score_elements

    _, video, mask = gallery(nv=7)
    assert indexed_score_elements(VideoEmbedding(clip=video, frame=video, frame_mask=mask)) == 8 * 7


def test_backbones_declare_what_their_retrieval_scoring_holds():
    """GMMFormer, v2 and ARL score through max_scores / vector_scores (8 floats a video per query);
    MamFusion's fused pairs keep the default, one value per video token."""
    from prvrlab.models.arl import ARLModel
    from prvrlab.models.base import RetrievalModel
    from prvrlab.models.gmmformer import GMMFormer
    from prvrlab.models.gmmformer_v2 import GMMFormerV2
    from prvrlab.models.mamfusion import MamFusion
    from prvrlab.models.scoring import indexed_score_elements

    _, video, mask = gallery(nv=7)
    emb = VideoEmbedding(clip=video, frame=video, frame_mask=mask)
    for model in (GMMFormer, GMMFormerV2, ARLModel):
        assert model.score_elements(emb) == 8 * 7 == indexed_score_elements(emb)
    assert MamFusion.score_elements is RetrievalModel.score_elements


def test_token_norms_of_a_bf16_gallery_in_pieces_equal_the_float32_ones():
    video = torch.randn(600, 3, 8, generator=torch.Generator().manual_seed(4)).bfloat16()  # 3 pieces of 256
    assert torch.equal(token_norms(video), token_norms(video.float()))


def test_max_scored_fields_are_the_low_precision_ones():
    """The fields a bf16 evaluation stores in bf16 are those each backbone scores with max_scores
    (clips; v2's and ARL's frames); MamFusion's own fused scoring takes float32 only."""
    from prvrlab.models.arl import ARLModel
    from prvrlab.models.gmmformer import GMMFormer
    from prvrlab.models.gmmformer_v2 import GMMFormerV2
    from prvrlab.models.ice_base import ICEBase
    from prvrlab.models.mamfusion import MamFusion

    assert GMMFormer.low_precision_fields == ICEBase.low_precision_fields == ("clip",)
    assert GMMFormerV2.low_precision_fields == ("clip", "frame") and ARLModel.low_precision_fields == ("frame",)
    assert MamFusion.low_precision_fields == ()


def test_retrieval_blocks_by_extent_equal_the_masked_fill_formula(monkeypatch):
    """Videos of mixed extents in split order (and one with a hole in its mask, one all padding) are
    scored in blocks of similar extent cut at their longest video's extent (a multiple of 16): the masked
    fill's max over the whole padded length (to float32 summation order), for any block size."""
    g = torch.Generator().manual_seed(5)
    nv, length, dim = 23, 70, 8
    lengths = torch.randint(1, length + 1, (nv,), generator=g)
    lengths[3], lengths[9] = length, 5
    mask = torch.arange(length)[None] < lengths[:, None]  # (Nv, L)
    mask[7, 2] = False  # a hole: not a prefix mask
    mask[11] = False  # all padding
    video = torch.randn(nv, length, dim, generator=g) * mask[..., None]
    query = torch.randn(6, dim, generator=g)
    norms = token_norms(video)
    expected = masked_fill_max(query, video, mask, norms)
    spans = []
    real_blocks = scoring._blocks
    monkeypatch.setattr(scoring, "_blocks", lambda *a: spans.append(real_blocks(*a)) or spans[-1])
    for block in (1 << 21, 6 * 40, 6 * 16, 1):
        monkeypatch.setattr(scoring, "_RETRIEVAL_BLOCK_ELEMENTS", block)
        with torch.no_grad():
            got = max_scores(query, video, mask, video_norm=norms).sim
        torch.testing.assert_close(got, expected, atol=SUM_ORDER, rtol=SUM_ORDER)
    assert got[:, 11].eq(-1.0).all()
    for videos, span in spans[-1]:  # blocks of one video: each cut at its own extent, rounded up to 16
        extent = int(mask[videos].nonzero()[:, 1].max()) + 1 if mask[videos].any() else 0
        assert span == min(length, max(1, -(-extent // 16) * 16))  # the all-padding video: one column
    assert sorted(int(i) for videos, _ in spans[-1] for i in videos) == list(range(nv))  # every video once
    assert sorted({span for _, span in spans[-1]}) == [1, 16, 32, 48, 64, 70]


def test_norms_of_a_bf16_gallery_are_read_piece_by_piece_into_one_result(monkeypatch):
    """A bf16 gallery is read in float32 a few videos at a time (never all of it): the norms are the
    whole gallery's bit for bit, and the bf16 check of a float32 field looks at every piece."""
    _, video, _ = gallery(nv=11, length=5, dim=6)
    low = video.bfloat16()
    monkeypatch.setattr(scoring, "_INDEX_PIECE_ELEMENTS", 2 * 5 * 6)  # two videos a piece: 6 pieces
    assert list(scoring._index_pieces(low)) == [0, 2, 4, 6, 8, 10]
    whole = low.float().norm(dim=-1).clamp(min=1e-6)  # (Nv, L)
    assert torch.equal(token_norms(low), whole)
    exact = low.float()
    assert index_token_norms(VideoEmbedding(clip=exact, frame=exact[:, 0]), ("clip",)).clip.dtype == torch.bfloat16
    exact[10, 4, 5] += 1e-3  # the last piece holds a value bf16 cannot: the field stays float32
    assert index_token_norms(VideoEmbedding(clip=exact, frame=exact[:, 0]), ("clip",)).clip.dtype == torch.float32


def test_training_scores_take_the_gradient_at_the_winners_as_the_plain_max_does():
    """The autograd path finds each max without autograd and differentiates only the winning dot: the same
    scores as the plain formula (divide, mask, max over every element), and the same gradients."""
    g = torch.Generator().manual_seed(3)
    query = torch.randn(6, 8, generator=g)
    video = torch.randn(5, 9, 8, generator=g)
    mask = torch.rand(5, 9, generator=g) > 0.4
    mask[2] = False  # no real vector: -1 and min-float, no gradient
    mask[0, 0] = True
    weights = torch.randn(2, 6, 5, generator=g)

    def plain(q, v):
        dots = torch.einsum("qd,vld->qvl", q, v)  # (Nq, Nv, L)
        cos = dots / (q.norm(dim=-1).clamp(min=1e-6)[:, None, None] * v.norm(dim=-1).clamp(min=1e-6)[None])
        pad = ~mask[None]
        return cos.masked_fill(pad, -1.0).amax(-1), dots.masked_fill(pad, torch.finfo(dots.dtype).min).amax(-1)

    def fast(q, v):
        scores = max_scores(q, v, mask, with_logits=True)
        return scores.sim, scores.logits

    got, expected = [], []
    for fn, out in ((fast, got), (plain, expected)):
        q, v = query.clone().requires_grad_(), video.clone().requires_grad_()
        sim, logits = fn(q, v)
        (weights[0] * sim + weights[1] * logits.clamp(min=-1e3)).sum().backward()
        out += [sim.detach(), logits.detach(), q.grad, v.grad]
    assert got[0][:, 2].eq(-1.0).all() and got[1][:, 2].eq(torch.finfo(torch.float32).min).all()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert got[3][2].abs().sum() == 0  # the video without a real vector gets no gradient


def test_training_scores_of_bf16_embeddings_run_on_bf16_units_with_float32_sums(monkeypatch):
    """bf16 query and video embeddings (bf16 autocast's outputs), with autograd: the scores are float32 sums
    of exact products, as from float32 copies of the same values (float32 summation error); the gradients
    reach the bf16 inputs within one more bf16 rounding of the incoming gradient (2^-8 of their scale);
    float32 embeddings keep the float32 products bit for bit."""
    g = torch.Generator().manual_seed(5)
    query = torch.randn(7, 64, generator=g).bfloat16()
    video = torch.randn(6, 11, 64, generator=g).bfloat16()
    mask = torch.rand(6, 11, generator=g) > 0.3
    mask[:, 0] = True
    weights = torch.randn(2, 7, 6, generator=g)

    def run(q, v):
        q, v = q.clone().requires_grad_(), v.clone().requires_grad_()
        scores = max_scores(q, v, mask, with_logits=True)
        (weights[0] * scores.sim + weights[1] * scores.logits).sum().backward()
        return scores.sim.detach(), scores.logits.detach(), q.grad, v.grad

    asked = []
    real = scoring.bf16_products

    def recording(enabled=True):
        asked.append(enabled)
        return real(enabled)

    monkeypatch.setattr(scoring, "bf16_products", recording)
    sim, logits, gq, gv = run(query, video)
    assert asked == [True, True]  # forward and backward asked for the bf16 units
    ref_sim, ref_logits, ref_gq, ref_gv = run(query.float(), video.float())
    assert asked == [True, True, False, False]  # float32 embeddings: float32 products
    assert sim.dtype == torch.float32 and gq.dtype == gv.dtype == torch.bfloat16
    torch.testing.assert_close(sim, ref_sim, atol=2e-6, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5 * float(ref_logits.abs().max()), rtol=0)
    for got, want in ((gq, ref_gq), (gv, ref_gv)):
        scale = float(want.abs().max())
        assert (got.float() - want).abs().max() <= 2**-8 * scale, float((got.float() - want).abs().max()) / scale
    q32, v32 = query.float().requires_grad_(), video.float().requires_grad_()
    flat = v32.reshape(-1, 64)
    dots = scoring._Dots.apply(q32, flat, False)
    assert torch.equal(dots, q32.detach() @ flat.detach().t())
    dots.sum().backward()
    assert torch.equal(q32.grad, torch.ones(7, 66) @ flat.detach())
    assert torch.equal(v32.grad.reshape(66, 64), torch.ones(66, 7) @ q32.detach())


def test_the_bf16_units_take_the_scores_backward_with_the_gradient_rounded_once():
    """Where the CPU has bf16 units: _Dots' backward equals float32 sums of the bf16-rounded incoming
    gradient times the (bf16-valued) embeddings, measurably not the float32 gradient's products, so the
    units did run (the float32 path would match the latter)."""
    from prvrlab.models.precision import bf16_products

    with bf16_products() as on:
        pass
    if not on:
        pytest.skip("no native bf16 matrix units here: _Dots runs float32 products")
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(6, 64, generator=gen).bfloat16().float().requires_grad_()
    v = torch.randn(50, 64, generator=gen).bfloat16().float().requires_grad_()
    dots = scoring._Dots.apply(q, v, True)
    torch.testing.assert_close(dots, q.detach() @ v.detach().t(), rtol=0, atol=1e-5)  # exact products
    g = torch.randn(6, 50, generator=gen)  # float32 values, not bf16-exact
    dots.backward(g)
    rounded = g.bfloat16().double() @ v.detach().double()  # (6, 64)
    exact = g.double() @ v.detach().double()
    scale = float(exact.abs().max())
    assert float((q.grad.double() - rounded).abs().max()) <= 1e-5 * scale
    assert float((q.grad.double() - exact).abs().max()) > 1e-4 * scale
