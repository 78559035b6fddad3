"""The dataset configs of methods with official code reproduce the official recipes.

Each table below was read from the official repository at the commit named
beside it; every row names the official file (``{ds}`` is the official
dataset key: tvr / act / cha) and holds the official value per dataset.  The
values are checked against the *resolved* config (``load_config`` fills in
every default), so an edit of a config or of a constructor default that
drifts from the official recipe fails here.  Synthetic presets and the paper-only
ICE base model are not reproductions and are not pinned (their headers say so).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from prvrlab.platform.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DATASETS = ("tvr", "activitynet", "charades")
OFFICIAL_KEY = {"tvr": "tvr", "activitynet": "act", "charades": "cha"}
INF = math.inf

# Rows: dotted key of the resolved config -> (tvr, activitynet, charades, official source).
# None in a dataset column: the official repository has no config for that dataset.

# github.com/huangmozhi9527/GMMFormer
GMMFORMER_COMMIT = "c38df37dda345292b6a9c490187262ccbdd2fd7c"
GMMFORMER = {
    "data.max_query_len": (30, 30, 30, "src/Configs/{ds}.py max_desc_l"),
    "data.max_frames": (128, 128, 128, "src/Configs/{ds}.py max_ctx_l"),
    "data.num_clips": (32, 32, 32, "src/Configs/{ds}.py map_size"),
    "data.normalize": ("official",) * 3 + ("src/Datasets/data_provider.py l2_normalize_np_array(eps=1e-5)",),
    "model.max_query_len": (30, 30, 30, "src/Models/gmmformer/model.py query_pos_embed(max_desc_l)"),
    "model.max_frames": (128, 128, 128, "src/Models/gmmformer/model.py clip/frame_pos_embed(max_ctx_l)"),
    "model.hidden_size": (384, 384, 384, "src/Configs/{ds}.py hidden_size"),
    "model.num_heads": (4, 4, 4, "src/Configs/{ds}.py n_heads"),
    "model.dropout": (0.2, 0.2, 0.15, "src/Configs/{ds}.py input_drop = drop"),
    "model.attention_dropout": (0.2, 0.2, 0.15, "src/Configs/{ds}.py drop -> attention_probs_dropout_prob"),
    "model.sigmas": ({0.5, 1.0, 5.0, INF},) * 3 + ("src/Models/gmmformer/model_components.py GMMBlock wid",),
    "model.num_gmm_blocks": (2, 2, 2, "src/Models/gmmformer/model.py clip_encoder(_2), frame_encoder_1/_2"),
    "model.window_length": ("batch",) * 3 + (
        "src/Datasets/data_provider.py collate_train / collate_frame_val pad to the batch's longest video; "
        "src/Models/gmmformer/model_components.py generate_gauss_weight(attention_scores.shape[-1])",
    ),
    "eval.video_batch_size": (100, 100, 100, "src/Configs/{ds}.py eval_context_bsz"),
    "model.query_redraw": (True,) * 3 + ("src/Models/gmmformer/model.py forward: video_query = self.encode_query(...) again",),
    "losses.query_diverse.branch": ("redrawn",) * 3 + ("src/Losses/loss.py qdl(query = input_list[-1]): the second encoding",),
    "model.ffn_size": (0, 0, 0, "src/Models/gmmformer/model_components.py BertAttention (no FFN)"),
    "model.clip_weight": (0.7, 0.7, 0.7, "src/Configs/{ds}.py clip_scale_w"),
    "model.frame_weight": (0.3, 0.3, 0.3, "src/Configs/{ds}.py frame_scale_w"),
    "losses.clip_triplet.weight": (1.0, 1.0, 1.0, "src/Losses/loss.py (triplet unweighted)"),
    "losses.frame_triplet.weight": (1.0, 1.0, 1.0, "src/Losses/loss.py (triplet unweighted)"),
    "losses.clip_triplet.margin": (0.1, 0.2, 0.2, "src/Configs/{ds}.py margin"),
    "losses.frame_triplet.margin": (0.1, 0.2, 0.2, "src/Configs/{ds}.py margin"),
    "losses.clip_triplet.hard_negative_start_epoch": (30, 20, 100, "src/Configs/{ds}.py hard_negative_start_epoch"),
    "losses.frame_triplet.hard_negative_start_epoch": (30, 20, 100, "src/Configs/{ds}.py hard_negative_start_epoch"),
    "losses.clip_triplet.hard_pool_size": (20, 20, 20, "src/Configs/{ds}.py hard_pool_size"),
    "losses.frame_triplet.hard_pool_size": (20, 20, 20, "src/Configs/{ds}.py hard_pool_size"),
    "losses.clip_triplet.v2t_hard_pool_size": (1, 1, 1, "src/Losses/loss.py v2t: neg_pair_scores[0]"),
    "losses.frame_triplet.v2t_hard_pool_size": (1, 1, 1, "src/Losses/loss.py v2t: neg_pair_scores[0]"),
    "losses.clip_nce.weight": (0.05, 0.02, 0.02, "src/Configs/{ds}.py loss_factor[0] (clip NCE, src/Losses/loss.py)"),
    "losses.frame_nce.weight": (0.04, 0.04, 0.02, "src/Configs/{ds}.py loss_factor[1] (frame NCE, src/Losses/loss.py)"),
    "losses.query_diverse.loss": ("query_diverse",) * 3 + ("src/Losses/loss.py query_diverse_loss",),
    "losses.query_diverse.weight": (1e-3, 0.015, 5e-3, "src/Configs/{ds}.py loss_factor[2] (query-diverse)"),
    "losses.query_diverse.delta": (0.15, 0.2, 0.15, "src/Configs/{ds}.py neg_factor[0]"),
    "losses.query_diverse.alpha": (32.0, 32.0, 32.0, "src/Configs/{ds}.py neg_factor[1]"),
    "train.epochs": (100, 100, 100, "src/Configs/{ds}.py n_epoch"),
    "train.batch_size": (128, 128, 128, "src/Configs/{ds}.py batchsize"),
    "train.lr": (3e-4, 2.5e-4, 2.5e-4, "src/Configs/{ds}.py lr"),
    "train.weight_decay": (0.01, 0.01, 0.01, "src/Configs/{ds}.py wd; src/Opts/builder.py"),
    "train.warmup_proportion": (0.01, 0.01, 0.01, "src/Configs/{ds}.py lr_warmup_proportion"),
    "train.grad_clip": (1.0, 1.0, 1.0, "src/Opts/optimization.py BertAdam max_grad_norm"),
    "train.early_stop_patience": (10, 10, 10, "src/Configs/{ds}.py max_es_cnt"),
    "train.seed": (9527, 9527, 9527, "src/Configs/{ds}.py seed"),
}

# github.com/huangmozhi9527/GMMFormer_v2
GMMFORMER_V2_COMMIT = "5bacac96f77408c2bef27c25637e2cf67fb062b9"
GMMFORMER_V2 = {
    "data.max_query_len": (30, 30, 30, "src/Configs/{ds}.py max_desc_l"),
    "data.max_frames": (128, 128, 128, "src/Configs/{ds}.py max_ctx_l"),
    "data.num_clips": (32, 32, 32, "src/Configs/{ds}.py map_size"),
    "data.normalize": ("official",) * 3 + ("src/Datasets/data_provider.py l2_normalize_np_array(eps=1e-5)",),
    "model.max_query_len": (30, 30, 30, "src/Models/gmmformerV2/model.py query_pos_embed(max_desc_l)"),
    "model.max_frames": (128, 128, 128, "src/Models/gmmformerV2/model.py clip/frame_pos_embed(max_ctx_l)"),
    "model.hidden_size": (384, 384, 384, "src/Configs/{ds}.py hidden_size"),
    "model.num_heads": (4, 4, 4, "src/Configs/{ds}.py n_heads"),
    "model.dropout": (0.2, 0.31, 0.25, "src/Configs/{ds}.py input_drop = drop"),
    "model.attention_dropout": (0.2, 0.31, 0.25, "src/Configs/{ds}.py drop -> attention_probs_dropout_prob"),
    "model.sigmas": ({0.1, 0.5, 1.0, 3.0, 5.0, 8.0, 10.0, INF},) * 3
    + ("src/Models/gmmformerV2/model_components.py DyGMMBlock wid",),
    "model.tau": (0.09, 0.6, 0.6, "src/Configs/{ds}.py sft_factor"),
    "model.aggregation": ("temporal",) * 3 + ("src/Models/gmmformerV2/model_components.py DyGMMBlock",),
    "model.num_blocks": (1, 1, 1, "src/Models/gmmformerV2/model.py clip_encoder, frame_encoder_1"),
    "model.norm_decay": (True,) * 3 + ("src/Opts/builder.py no_decay = LayerNorm.* names; BertAttention's norm1/norm2 decayed",),
    "model.ffn_size": (None, None, None, "src/Models/gmmformerV2/model_components.py FeedForward(4*hidden)"),
    "model.attention_output": ("official",) * 3 + ("src/Models/gmmformerV2/model_components.py BertAttention: norm1(x + dropout1(self_output)), no output projection",),
    "model.query_activation": ("relu",) * 3 + ("src/Models/gmmformerV2/model_components.py FeedForward: F.relu",),
    "model.ffn_dropout": (True,) * 3 + ("src/Models/gmmformerV2/model_components.py FeedForward: dropout(F.relu(layer1(x)))",),
    "model.cross_attention_dropout": (True,) * 3 + ("src/Models/gmmformerV2/model_components.py BertCrossAttention's BertSelfAttention dropout(attention_probs)",),
    "model.weight_token": ("shared",) * 3 + ("src/Models/gmmformerV2/model.py one weight_token passed to clip_encoder and frame_encoder_1",),
    "model.query_redraw": (True,) * 3 + ("src/Models/gmmformerV2/model.py forward: video_query = self.encode_query(...) again",),
    "losses.query_diverse.branch": ("redrawn",) * 3 + ("src/Losses/loss.py qdl(query): forward's second query encoding",),
    "losses.optimal_matching.branch": ("redrawn",) * 3 + ("src/Models/gmmformerV2/model.py total_sim over video_query",),
    "model.clip_weight": (0.7, 0.7, 0.7, "src/Configs/{ds}.py clip_scale_w"),
    "model.frame_weight": (0.3, 0.3, 0.3, "src/Configs/{ds}.py frame_scale_w"),
    "losses.clip_triplet.weight": (1.0, 1.0, 1.0, "src/Losses/loss.py (triplet unweighted)"),
    "losses.frame_triplet.weight": (1.0, 1.0, 1.0, "src/Losses/loss.py (triplet unweighted)"),
    "losses.clip_triplet.margin": (0.1, 0.2, 0.2, "src/Configs/{ds}.py margin"),
    "losses.frame_triplet.margin": (0.1, 0.2, 0.2, "src/Configs/{ds}.py margin"),
    "losses.clip_triplet.hard_negative_start_epoch": (20, 20, 20, "src/Configs/{ds}.py hard_negative_start_epoch"),
    "losses.frame_triplet.hard_negative_start_epoch": (20, 20, 20, "src/Configs/{ds}.py hard_negative_start_epoch"),
    "losses.clip_triplet.hard_pool_size": (20, 20, 20, "src/Configs/{ds}.py hard_pool_size"),
    "losses.frame_triplet.hard_pool_size": (20, 20, 20, "src/Configs/{ds}.py hard_pool_size"),
    "losses.clip_triplet.v2t_hard_pool_size": (1, 1, 1, "src/Losses/loss.py v2t: neg_pair_scores[0]"),
    "losses.frame_triplet.v2t_hard_pool_size": (1, 1, 1, "src/Losses/loss.py v2t: neg_pair_scores[0]"),
    "losses.clip_nce.weight": (0.05, 0.02, 0.02, "src/Configs/{ds}.py loss_factor[0] (clip NCE, src/Losses/loss.py)"),
    "losses.frame_nce.weight": (0.04, 0.04, 0.04, "src/Configs/{ds}.py loss_factor[1] (frame NCE, src/Losses/loss.py)"),
    "losses.query_diverse.loss": ("query_diverse_focal",) * 3 + ("src/Losses/loss.py query_diverse_loss (focal)",),
    "losses.query_diverse.weight": (8e-5, 3e-3, 3e-3, "src/Configs/{ds}.py loss_factor[2] (query-diverse)"),
    "losses.query_diverse.delta": (0.15, 0.2, 0.2, "src/Configs/{ds}.py neg_factor[0]"),
    "losses.query_diverse.alpha": (32.0, 32.0, 32.0, "src/Configs/{ds}.py neg_factor[1]"),
    "losses.query_diverse.gamma": (1.0, 1.0, 1.0, "src/Configs/{ds}.py neg_factor[2]"),
    "losses.optimal_matching.weight": (0.09, 0.11, 0.1, "src/Configs/{ds}.py loss_factor[3] (ot_loss)"),
    "train.epochs": (100, 100, 100, "src/Configs/{ds}.py n_epoch"),
    "train.batch_size": (128, 128, 128, "src/Configs/{ds}.py batchsize"),
    "train.lr": (3e-4, 2.5e-4, 2e-4, "src/Configs/{ds}.py lr"),
    "train.weight_decay": (0.01, 0.01, 0.01, "src/Configs/{ds}.py wd; src/Opts/builder.py"),
    "train.warmup_proportion": (0.01, 0.01, 0.01, "src/Configs/{ds}.py lr_warmup_proportion"),
    "train.grad_clip": (1.0, 1.0, 1.0, "src/Opts/optimization.py BertAdam max_grad_norm"),
    "train.early_stop_patience": (10, 10, 10, "src/Configs/{ds}.py max_es_cnt"),
    "train.seed": (9527, 9527, 9527, "src/Configs/{ds}.py seed"),
}

# github.com/HuiGuanLab/ms-sl (no per-dataset config files: method/config.py defaults, do_{dataset}.sh overrides)
MSSL_COMMIT = "e014c318860e11cffed379463c917d809846f31b"
MSSL = {
    "data.max_query_len": (30, 30, 30, "method/config.py --max_desc_l"),
    "data.max_frames": (128, 128, 128, "method/config.py --max_ctx_l"),
    "data.num_clips": (32, 32, 32, "method/config.py --map_size"),
    "data.normalize": ("official",) * 3 + ("method/data_provider.py l2_normalize_np_array(eps=1e-5)",),
    "model.max_query_len": (30, 30, 30, "method/model.py query_pos_embed(max_desc_l)"),
    "model.max_frames": (128, 128, 128, "method/model.py clip/frame_pos_embed(max_ctx_l)"),
    "model.hidden_size": (384, 384, 384, "method/config.py --hidden_size"),
    "model.num_heads": (4, 4, 4, "method/config.py --n_heads"),
    "model.dropout": (0.1, 0.1, 0.1, "method/config.py --input_drop = --drop"),
    "model.attention_dropout": (0.1, 0.1, 0.1, "method/config.py --drop -> attention_probs_dropout_prob"),
    "model.max_window": (32, 32, 32, "method/model.py AvgPool1d(1..map_size)"),
    "model.ffn_size": (0, 0, 0, "method/model.py BertAttention encoders (no FFN)"),
    "model.clip_weight": (0.7, 0.7, 0.5, "method/config.py --clip_scale_w; do_charades.sh"),
    "model.frame_weight": (0.3, 0.3, 0.5, "method/config.py --frame_scale_w; do_charades.sh"),
    "losses.clip_triplet.weight": (1.0, 1.0, 1.0, "method/model.py (triplet unweighted)"),
    "losses.frame_triplet.weight": (1.0, 1.0, 1.0, "method/model.py (triplet unweighted)"),
    "losses.clip_triplet.margin": (0.1, 0.2, 0.2, "method/config.py --margin; do_tvr.sh"),
    "losses.frame_triplet.margin": (0.1, 0.2, 0.2, "method/config.py --margin; do_tvr.sh"),
    "losses.clip_triplet.hard_negative_start_epoch": (20, 20, 20, "method/config.py --hard_negative_start_epoch"),
    "losses.frame_triplet.hard_negative_start_epoch": (20, 20, 20, "method/config.py --hard_negative_start_epoch"),
    "losses.clip_triplet.hard_pool_size": (20, 20, 20, "method/config.py --hard_pool_size"),
    "losses.frame_triplet.hard_pool_size": (20, 20, 20, "method/config.py --hard_pool_size"),
    "losses.clip_nce.weight": (0.02, 0.02, 0.02, "method/model.py clip_nce_loss = 0.02 * ..."),
    "losses.frame_nce.weight": (0.04, 0.04, 0.04, "method/model.py frame_nce_loss = 0.04 * ..."),
    "model.frame_training": ("official",) * 3 + ("method/model.py key_clip_guided_attention (own video only)",),
    "losses.clip_nce.form": ("two_sided",) * 3 + ("method/model_components.py clip_nce",),
    "losses.frame_nce.form": ("joint",) * 3 + ("method/model_components.py frame_nce (row ++ column)",),
    "losses.clip_triplet.v2t_hard_pool_size": (1, 1, 1, "method/model.py get_clip_triplet_loss (v2t: the hardest)"),
    "losses.frame_triplet.v2t_hard_pool_size": (20, 20, 20, "method/model.py get_frame_trip_loss -> get_neg_scores"),
    "train.epochs": (100, 100, 100, "method/config.py --n_epoch"),
    "train.batch_size": (128, 128, 128, "method/config.py --bsz"),
    "train.lr": (2.5e-4, 2.5e-4, 2.5e-4, "method/config.py --lr (no do_*.sh overrides it)"),
    "train.weight_decay": (0.01, 0.01, 0.01, "method/config.py --wd; method/train.py"),
    "train.warmup_proportion": (0.01, 0.01, 0.01, "method/config.py --lr_warmup_proportion"),
    "train.grad_clip": (1.0, 1.0, 1.0, "method/optimization.py BertAdam max_grad_norm"),
    "train.early_stop_patience": (10, 10, 10, "method/config.py --max_es_cnt"),
    "train.seed": (2018, 2018, 2018, "method/config.py --seed"),
}

# github.com/zhanglong-ustc/RAL-PRVR: RAL on GMMFormer v2, Configs for tvr and act only (cha.py ships as .pyc only)
RAL_COMMIT = "befbf223aba825a0e494c32916d39e6525506113"
_V2_KEEP = (k for k in GMMFORMER_V2 if k not in ("model.clip_weight", "model.frame_weight", "train.epochs", "train.early_stop_patience"))
RAL_GMMFORMER_V2 = {
    **{key: (*GMMFORMER_V2[key][:2], None, GMMFORMER_V2[key][3]) for key in _V2_KEEP},  # same keys and values
    "model.clip_weight": (0.5, 0.6, None, "src/Configs/{ds}.py clip_scale_w"),
    "model.frame_weight": (0.5, 0.4, None, "src/Configs/{ds}.py frame_scale_w"),
    "train.epochs": (150, 100, None, "src/Configs/{ds}.py n_epoch"),
    "train.early_stop_patience": (15, 10, None, "src/Configs/{ds}.py max_es_cnt"),
    "plugins.ral.num_proxies": (6, 6, None, "src/Models/RAL4gmmv2/model.py n_video_samples = n_text_samples = 6"),
    "plugins.ral.csa_padding": ("official", "official", None, "src/Models/RAL4gmmv2/model.py weighted_token_wise_intersection (padding to 128 scores 0)"),
    "plugins.ral.word_encoder": ("own", "own", None, "src/Models/RAL4gmmv2/model.py frame_branch_query_proj + frame_branch_query_encoder"),
    "plugins.ral.word_positions": ("shared", "shared", None, "src/Models/RAL4gmmv2/model.py encode_frame_query(..., self.query_pos_embed)"),
    "plugins.ral.heads_padding": ("official", "official", None, "src/Models/RAL4gmmv2/model.py encode_context (zero frames up to 128) -> probabilistic_video"),
    "plugins.ral.text_heads_padding": ("official", "official", None, "src/Models/RAL4gmmv2/model.py encode_frame_query (outputs at padded words kept) -> support_set -> probabilistic_text"),
    "plugins.ral.support_pad_queries": (26, 26, None, "src/Models/RAL4gmmv2/model.py support_set num = query_matrix.shape[1] * 26"),
    "plugins.ral.norm_decay": (True, True, None, "src/Opts/builder.py no_decay names miss pie_model.py layer_norm, BertAttention norm1/norm2"),
    "plugins.ral.logvar_range": ("official", "official", None, "src/Models/RAL4gmmv2/prob_models/uncertainty_module.py UncertaintyModuleImage: logsigma = fc(residual) + fc2(out), no clamp"),
    "plugins.ral.heads": ("official", "official", None, "src/Models/RAL4gmmv2/prob_models/pie_model.py, uncertainty_module.py"),
    "plugins.ral.msra": (True, True, None, "src/Models/RAL4gmmv2/model.py (probabilistic embeddings, MIL/vib losses)"),
    "plugins.ral.csa": (True, True, None, "src/Models/RAL4gmmv2/model.py (word-confidence frame scores)"),
    "losses.ral_pm.weight": (4e-3, 4e-3, None, "src/Losses/loss.py MIL_loss = 4e-3 * ..."),
    "losses.ral_da.weight": (2.5e-4, 2.5e-4, None, "src/Losses/loss.py vib_loss = 2.5e-4 * ..."),
}

# github.com/Vision-Multimodal-Lab-HZCU/MamFusion (GMMFormer + Mamba; src/Configs/{ds}.yaml + builder.py)
MAMFUSION_COMMIT = "efa33f91e6f291c57b059a28f4ba47402adee674"
MAMFUSION = {
    "data.max_query_len": (30, 30, 30, "src/Configs/{ds}.yaml max_desc_l"),
    "data.max_frames": (512, 256, 1024, "src/Configs/{ds}.yaml max_ctx_l (uniform_feature_sampling)"),
    "data.num_clips": (32, 32, 32, "src/Configs/builder.py map_size"),
    "data.normalize": ("official",) * 3 + ("src/Datasets/data_provider.py l2_normalize_np_array(eps=1e-5)",),
    "model.max_frames": (512, 256, 1024, "src/Models/model_mamba.py clip/frame_pos_embed(max_ctx_l)"),
    "model.max_query_len": (30, 30, 30, "src/Models/model_mamba.py query_pos_embed(max_desc_l)"),
    "model.hidden_size": (384, 384, 384, "src/Configs/{ds}.yaml hidden_size"),
    "model.num_heads": (8, 8, 4, "src/Configs/{ds}.yaml n_heads"),
    "model.input_dropout": (0.2, 0.2, 0.15, "src/Configs/{ds}.yaml input_drop"),
    "model.dropout": (0.45, 0.18, 0.3, "src/Configs/{ds}.yaml drop -> hidden_dropout_prob"),
    "model.attention_dropout": (0.45, 0.18, 0.3, "src/Configs/{ds}.yaml drop -> attention_probs_dropout_prob"),
    "model.sigmas": ({0.5, 1.0, 5.0, INF},) * 3 + ("src/Models/model_components.py GMMBlock wid",),
    "model.num_gmm_blocks": (2, 2, 2, "src/Models/model_mamba.py clip_encoder(_2), frame_encoder_1/_2"),
    "model.window_length": ("batch",) * 3 + (
        "src/Datasets/data_provider.py collate_train / collate_frame_val pad to the batch's longest video; "
        "src/Models/model_components.py generate_gauss_weight(attention_scores.shape[-1])",
    ),
    "eval.video_batch_size": (100, 100, 100, "src/Configs/{ds}.yaml eval_context_bsz"),
    "model.query_redraw": (True,) * 3 + ("src/Models/model_mamba.py forward: video_query = self.encode_query(...) again, fused",),
    "model.ffn_size": (0, 0, 0, "src/Models/model_components.py BertAttention (no FFN)"),
    "model.clip_weight": (0.7, 0.7, 0.7, "src/Configs/builder.py clip_scale_w"),
    "model.frame_weight": (0.3, 0.3, 0.3, "src/Configs/builder.py frame_scale_w"),
    "model.mamba": (True, True, True, "src/Models/model_mamba.py *_mamba after every GMMBlock"),
    "model.d_state": (16, 16, 16, "src/Models/model_mamba.py Mamba(d_state=16)"),
    "model.d_conv": (4, 4, 4, "src/Models/model_mamba.py Mamba(d_conv=4)"),
    "model.expand": (2, 2, 2, "src/Models/model_mamba.py Mamba(expand=2)"),
    "model.mask_padding": (False, False, False, "src/Models/model_mamba.py Mamba(x) without the video mask"),
    "model.mamba_init": ("official",) * 3 + ("src/Models/model_mamba.py reset_parameters (re_init covers Mamba's Linears)",),
    "model.mamba_residual": ("official",) * 3 + ("src/Models/model_mamba.py nn.LayerNorm after Mamba, default scale 1",),
    "model.mamba_norm_decay": (True, True, True, "src/Opts/builder.py no_decay names miss '*_mamba.1.weight'"),
    "model.fusion": ("batch",) * 3 + ("src/Models/model_mamba.py VisionLanguageFusionModule over the batch",),
    "model.fusion_init": ("official",) * 3 + ("src/Models/model_mamba.py nn.MultiheadAttention (reset_parameters: nn.Linear only)",),
    "model.t2v": (True, True, True, "src/Models/model_mamba.py v2t_fusion(tgt=videos, memory=queries)"),
    "model.v2t": (True, True, True, "src/Models/model_mamba.py t2v_fusion(tgt=queries, memory=videos)"),
    "model.fusion_at_retrieval": (False, False, False, "src/Models/model_mamba.py scores use unfused queries"),
    "losses.clip_triplet.weight": (1.0, 1.0, 1.0, "src/Losses/loss.py (triplet unweighted)"),
    "losses.frame_triplet.weight": (1.0, 1.0, 1.0, "src/Losses/loss.py (triplet unweighted)"),
    "losses.clip_triplet.margin": (0.2, 0.2, 0.2, "src/Configs/{ds}.yaml margin"),
    "losses.frame_triplet.margin": (0.2, 0.2, 0.2, "src/Configs/{ds}.yaml margin"),
    "losses.clip_triplet.hard_negative_start_epoch": (20, 20, 100, "src/Configs/{ds}.yaml hard_negative_start_epoch"),
    "losses.frame_triplet.hard_negative_start_epoch": (20, 20, 100, "src/Configs/{ds}.yaml hard_negative_start_epoch"),
    "losses.clip_triplet.hard_pool_size": (20, 20, 20, "src/Configs/{ds}.yaml hard_pool_size"),
    "losses.frame_triplet.hard_pool_size": (20, 20, 20, "src/Configs/{ds}.yaml hard_pool_size"),
    "losses.clip_triplet.v2t_hard_pool_size": (1, 1, 1, "src/Losses/loss.py v2t: neg_pair_scores[0]"),
    "losses.frame_triplet.v2t_hard_pool_size": (1, 1, 1, "src/Losses/loss.py v2t: neg_pair_scores[0]"),
    "losses.clip_nce.weight": (0.027, 0.027, 0.008, "src/Configs/{ds}.yaml loss_factor[0] (clip NCE)"),
    "losses.frame_nce.weight": (0.045, 0.045, 0.01, "src/Configs/{ds}.yaml loss_factor[1] (frame NCE)"),
    "losses.query_diverse.loss": ("query_diverse",) * 3 + ("src/Losses/loss.py query_diverse_loss",),
    "losses.query_diverse.branch": ("fused",) * 3 + ("src/Losses/loss.py qdl(input_list[-1]: the fused query)",),
    "losses.query_diverse.weight": (0.015, 0.015, 0.005, "src/Configs/{ds}.yaml loss_factor[2] (query-diverse)"),
    "losses.query_diverse.delta": (0.2, 0.2, 0.15, "src/Configs/{ds}.yaml neg_factor[0]"),
    "losses.query_diverse.alpha": (32.0, 32.0, 32.0, "src/Configs/{ds}.yaml neg_factor[1]"),
    "train.epochs": (200, 200, 400, "src/Configs/{ds}.yaml n_epoch"),
    "train.batch_size": (256, 64, 64, "src/Configs/{ds}.yaml batchsize"),
    "train.lr": (4.5e-4, 4.5e-4, 3.8e-4, "src/Configs/{ds}.yaml lr"),
    "train.weight_decay": (0.01, 0.01, 0.01, "src/Configs/{ds}.yaml wd; src/Opts/builder.py"),
    "train.warmup_proportion": (0.01, 0.01, 0.01, "src/Configs/{ds}.yaml lr_warmup_proportion"),
    "train.grad_clip": (1.0, 1.0, 1.0, "src/Opts/optimization.py BertAdam max_grad_norm"),
    "train.early_stop_patience": (200, 200, 10, "src/Configs/{ds}.yaml max_es_cnt"),
    "train.seed": (9527, 9527, 9527, "src/Configs/builder.py seed"),
}

METHODS = {
    # config prefix: (repository, commit, table)
    "gmmformer": ("huangmozhi9527/GMMFormer", GMMFORMER_COMMIT, GMMFORMER),
    "gmmformer_v2": ("huangmozhi9527/GMMFormer_v2", GMMFORMER_V2_COMMIT, GMMFORMER_V2),
    "mssl": ("HuiGuanLab/ms-sl", MSSL_COMMIT, MSSL),
    "gmmformer_v2_ral": ("zhanglong-ustc/RAL-PRVR", RAL_COMMIT, RAL_GMMFORMER_V2),
    "mamfusion": ("Vision-Multimodal-Lab-HZCU/MamFusion", MAMFUSION_COMMIT, MAMFUSION),
}

CASES = [
    (prefix, dataset)
    for prefix, (_, _, table) in METHODS.items()
    for i, dataset in enumerate(DATASETS)
    if any(row[i] is not None for row in table.values())
]


def _same(actual, expected) -> bool:
    if isinstance(expected, set):
        return isinstance(actual, list) and len(actual) == len(expected) and {float(a) for a in actual} == expected
    if isinstance(expected, bool) or expected is None or isinstance(expected, str):
        return actual is expected or actual == expected
    if isinstance(expected, float):
        return isinstance(actual, (int, float)) and actual == pytest.approx(expected, rel=1e-12, abs=0.0)
    return type(actual) is type(expected) and actual == expected


@pytest.mark.parametrize(("prefix", "dataset"), CASES, ids=[f"{p}_{d}" for p, d in CASES])
def test_dataset_config_matches_the_official_recipe(prefix, dataset):
    repo, commit, table = METHODS[prefix]
    path = CONFIGS / f"{prefix}_{dataset}.yaml"
    flat = load_config(path).flat()  # resolved: constructor defaults filled in
    column = DATASETS.index(dataset)
    wrong = []
    for key, row in table.items():
        expected, source = row[column], row[3].format(ds=OFFICIAL_KEY[dataset])
        if expected is None:
            continue
        actual = flat.get(key, "<missing>")
        if not _same(actual, expected):
            wrong.append(f"{key}: {actual!r}, official {expected!r} ({repo} @ {commit[:7]} {source})")
    assert not wrong, f"{path.name} drifts from the official recipe:\n" + "\n".join(wrong)


@pytest.mark.parametrize(("prefix", "dataset"), CASES, ids=[f"{p}_{d}" for p, d in CASES])
def test_dataset_config_cites_the_official_repository_and_commit(prefix, dataset):
    repo, commit, _ = METHODS[prefix]
    header = (CONFIGS / f"{prefix}_{dataset}.yaml").read_text()
    assert f"github.com/{repo} @ {commit}" in header


def test_every_dataset_config_with_official_code_is_pinned():
    """A new <method>_<dataset>.yaml of a method with official code must get a column above."""
    pinned = {f"{p}_{d}.yaml" for p, d in CASES}
    official = {
        path.name
        for path in CONFIGS.glob("*.yaml")
        if path.stem.rsplit("_", 1)[-1] in DATASETS and path.stem.rsplit("_", 1)[0] in METHODS
    }
    assert official <= pinned, f"not pinned: {sorted(official - pinned)}"


def test_presets_that_are_not_reproductions_say_so():
    for path in sorted(CONFIGS.glob("*_synth.yaml")):
        assert "NOT A REPRODUCTION" in path.read_text(), path.name
    for dataset in DATASETS:
        assert "No official code" in (CONFIGS / f"ice_base_{dataset}.yaml").read_text()
