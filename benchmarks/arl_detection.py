"""How well ARL's label-ambiguity detection (paper 001, Eqs. 4-7) finds truly relevant unpaired pairs.

Trains configs/arl_synth.yaml in-process on a synthetic collection and, at
the start of every epoch, encodes the training split with the current model
(the plug-in's own epoch-start pass), forms every in-batch unpaired pair's
similarity s and pair uncertainty u = (U^q_i + U^v_{j,k_hat}) / 2 and prints,
against the generator's ground truth (truly relevant unpaired pairs):

- the base rate, and how well s, u, U^q and U^v_{k_hat} alone rank relevant
  above irrelevant unpaired pairs (ROC AUC; 0.5 = no signal);
- tau_s (the paper's rule: mean s of positive pairs), tau_u by two readings
  of "the mean of the uncertainty distribution of the train dataset": the
  mean of u over text-video pairs (the distribution of the paper's Fig. 4b;
  the plug-in's rule) and the mean over text-frame pairs m_q . m_f (an
  earlier reading);
- precision / recall / number detected for a grid of (tau_s, tau_u).

    PYTHONPATH=. .venv/bin/python benchmarks/arl_detection.py --preset small --epochs 4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

from prvrlab.losses._common import positive_mask
from prvrlab.models.plugins.arl import ARL, best_frame, frame_similarity
from prvrlab.platform.config import validate

ROOT = Path(__file__).resolve().parents[1]


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """ROC AUC of ``score`` for ``label`` (Mann-Whitney, ties counted half)."""
    pos, neg = score[label].double(), score[~label].double()
    if not len(pos) or not len(neg):
        return float("nan")
    ranks = torch.empty(len(score), dtype=torch.float64)
    order = torch.argsort(score.double())
    sorted_scores = score.double()[order]
    ranks[order] = torch.arange(1, len(score) + 1, dtype=torch.float64)
    # average ranks over ties
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    return float((ranks[label].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def analyse(plugin: ARL, ctx) -> None:
    tables = plugin.dataset_uncertainty(ctx)[0]
    s_all, u_all, uq_all, uv_all, rel_all = [], [], [], [], []
    for batch in ctx.train_batches():
        video, query = ctx.encode(batch)
        q, frames, mask = plugin.encoder_views(query, video)[0]
        sim = frame_similarity(q, frames)  # (Nq, Nv, Lf)
        s, k_hat = best_frame(sim, mask)  # (Nq, Nv)
        query_unc, frame_unc = tables.lookup(batch.query_ids, batch.video_ids, mask.shape[1])
        uv = frame_unc[torch.arange(len(batch.video_ids))[None], k_hat]  # (Nq, Nv) U^v at k_hat
        uq = query_unc[:, None].expand_as(s)  # (Nq, Nv)
        u = 0.5 * (uq + uv)
        positive = positive_mask(batch.query_video, s.shape[1])  # (Nq, Nv)
        relevant = ctx.truth.relevant(batch.query_ids, batch.video_ids)  # (Nq, Nv)
        unpaired = ~positive
        s_all.append(s[unpaired]), u_all.append(u[unpaired]), uq_all.append(uq[unpaired])
        uv_all.append(uv[unpaired]), rel_all.append(relevant[unpaired])
    s, u, uq, uv, rel = (torch.cat(x) for x in (s_all, u_all, uq_all, uv_all, rel_all))
    tau_s, tau_u_pair = tables.tau_s, tables.tau_u  # the plug-in's rule: mean u over text-video pairs
    tau_u_frame = float(tables.query.double().mean())  # mean of U^q = m_q . m_f, the mean over text-frame pairs
    print(f"\n== epoch {ctx.epoch}: {len(s)} unpaired in-batch pairs, base rate {rel.float().mean():.2%}")
    print(f"AUC relevant vs irrelevant unpaired: s {auc(s, rel):.3f}  u {auc(u, rel):.3f}  "
          f"U^q {auc(uq, rel):.3f}  U^v(k_hat) {auc(uv, rel):.3f}")
    print(f"tau_s (rule) {tau_s:.4f}; tau_u: m_q.m_f {tau_u_frame:.4f}, mean pair u {tau_u_pair:.4f}; "
          f"mean u of unpaired with s > tau_s {float(u[s > tau_s].mean()) if (s > tau_s).any() else float('nan'):.4f}")
    s_grid = {"rule": tau_s, **{f"q{int(p * 100)}": float(torch.quantile(s, p)) for p in (0.5, 0.9, 0.99)}}
    u_grid = {"none": -2.0, "m_q.m_f": tau_u_frame, "pair mean": tau_u_pair,
              **{f"q{int(p * 100)}": float(torch.quantile(u, p)) for p in (0.75, 0.9)}}
    print(f"{'tau_s':>14} {'tau_u':>18} {'detected':>9} {'precision':>9} {'recall':>7}")
    for s_name, ts in s_grid.items():
        for u_name, tu in u_grid.items():
            found = (s > ts) & (u > tu)
            n = int(found.sum())
            precision = float((found & rel).sum()) / n if n else float("nan")
            recall = float((found & rel).sum()) / max(int(rel.sum()), 1)
            print(f"{s_name:>6} {ts:7.4f} {u_name:>10} {tu:7.4f} {n:9d} {precision:9.2%} {recall:7.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--data", default=str(ROOT / "results" / "data"))
    parser.add_argument("--out", default=str(ROOT / "results" / "arl_detection"))
    args = parser.parse_args()
    from prvrlab.platform.train.driver import train

    raw = yaml.safe_load((ROOT / "configs" / "arl_synth.yaml").read_text())
    raw["data"].update(root=str(Path(args.data) / args.preset), synthesize=args.preset)
    raw["model"].update(hidden_size=args.hidden, ffn_size=2 * args.hidden)
    raw["plugins"]["arl"].update(warmup_epochs=1)
    raw["train"].update(epochs=args.epochs, num_workers=1)
    raw["eval"] = {"final_splits": ["val"]}
    out = Path(args.out)
    raw["tracking"] = {"uri": f"sqlite:///{out / 'mlflow.db'}", "experiment": "arl-detection",
                       "storage_path": str(out / "runs")}
    out.mkdir(parents=True, exist_ok=True)
    start = ARL.on_epoch_start

    def on_epoch_start(self, ctx):
        analyse(self, ctx)
        return start(self, ctx)

    ARL.on_epoch_start = on_epoch_start
    train(validate(raw), use_ray=False, echo=None)


if __name__ == "__main__":
    main()
