"""Golden values for verl's "gspo", "cispo" and "vanilla" policy losses.

Not part of the suite, and verl is not a dependency: run once, in a separate virtual
environment with a CPU torch and ``pip install --no-deps verl==0.9.1`` plus what its import
needs (numpy, packaging, omegaconf, codetiming, orjson, tensordict, transformers, ray: imported,
never started):  python tests/data/make_verl_policy_losses.py
Writes verl_policy_losses.json beside this file (tests/rl/test_policy_losses.py reads it).

Every case calls verl through core_algos.get_policy_loss_fn(name) with a
verl.workers.config.ActorConfig (gspo/cispo assert isinstance(config, ActorConfig)),
an empty config.global_batch_info (=> single-rank, local normalisation) and a bool
response_mask (as verl's ppo_loss passes it). Gradients are d loss / d log_prob
from torch autograd in float64. An independent numpy re-implementation of the
formulas (as the modules of grpo_jax/rl/policy_losses state them) is checked against verl
for every case.
"""

import json
import math
import os

import numpy as np
import torch

import verl
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig, PolicyLossConfig

torch.set_default_dtype(torch.float64)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_policy_losses.json")

MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]

# ---------------- GSPO inputs (per-row advantages broadcast over tokens) ----------------
GSPO_OLD = [[-1.2, -0.7, -2.3, -0.4], [-0.9, -1.6, -6.0, -0.2], [-2.0, -3.5, -1.1, -4.0]]
# log_prob - old_log_prob; masked positions get large arbitrary deltas
GSPO_DELTA = [[0.02, -0.01, 0.03, 0.0], [-0.4, -0.3, 5.0, -7.0], [-0.002, 3.0, -2.0, 1.5]]
GSPO_ADV_ROW = [1.0, -0.5, 2.0]

# GSPO case exercising the max=10 clamp on the (sequence) log ratio in row 0
CLAMP_OLD = [[-12.0, -13.0, -11.5, -14.0], [-0.9, -1.6, -6.0, -0.2], [-2.0, -3.5, -1.1, -4.0]]
CLAMP_DELTA = [[11.0, 11.0, 11.0, 11.0], [-0.4, -0.3, 5.0, -7.0], [-0.002, 3.0, -2.0, 1.5]]
CLAMP_ADV_ROW = [-1.0, -0.5, 2.0]

# ---------------- CISPO / vanilla inputs (per-token, mixed-sign advantages) ----------------
TOK_OLD = [[-1.5, -0.3, -2.2, -2.0], [-0.8, -1.9, -4.5, -0.6], [-1.3, -3.0, -3.3, -9.0]]
TOK_DELTA = [[0.5, -0.4, 0.1, 1.3], [-0.6, 0.3, 4.0, -6.0], [0.05, 2.5, -3.0, 8.0]]
TOK_ADV = [[1.0, 1.0, -0.5, -0.5], [-1.5, 0.8, 0.3, -0.2], [2.0, -1.0, 0.7, 0.4]]

ROLLOUT_IS_W = [[0.9, 1.1, 1.0, 0.7], [1.2, 0.8, 3.0, 5.0], [0.5, 2.0, 2.0, 2.0]]


def add(a, b):
    return [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def bcast(row_vals, T=4):
    return [[v] * T for v in row_vals]


def make_config(mode, clip_low, clip_high, agg, clip_ratio_c=3.0):
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        use_torch_compile=False,
        clip_ratio=clip_low,  # only used as fallback when clip_ratio_low/high is None
        clip_ratio_low=clip_low,
        clip_ratio_high=clip_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=agg,
        policy_loss=PolicyLossConfig(loss_mode=mode),
    )


# ---------------- independent numpy reference (from FORMULAS.md) ----------------
def np_agg_weights(mask, agg):
    """Weight w[i,t] such that loss = sum(w * loss_mat)."""
    m = mask.astype(np.float64)
    if agg == "token-mean":
        return m / m.sum()
    if agg == "seq-mean-token-mean":
        n = m.sum(-1, keepdims=True)
        nseq = (n > 0).sum()
        return m / (n + 1e-8) / nseq
    raise ValueError(agg)


def np_reference(mode, old, lp, adv, mask, lo, hi, agg, c=3.0, w_is=None):
    m = mask.astype(bool)
    W = np_agg_weights(mask, agg)
    wis = np.ones_like(lp) if w_is is None else w_is
    d = lp - old
    if mode == "gspo":
        n = np.maximum(m.sum(-1), 1)
        seq_lr = (d * m).sum(-1) / n
        lr = np.minimum(seq_lr, 10.0)[:, None] * np.ones_like(lp)
        s = np.exp(lr)
        l1, l2 = -adv * s, -adv * np.clip(s, 1 - lo, 1 + hi)
        unclipped = l1 >= l2  # torch.maximum picks l1 on ties
        loss_mat = np.maximum(l1, l2) * wis
        # d/dlp: only through the token term exp(lp - sg(lp)); zero if clipped branch or clamp active
        gate = unclipped & (seq_lr <= 10.0)[:, None]
        g_mat = np.where(gate, -adv * s, 0.0) * wis
        clipfrac = ((l2 > l1) & m).sum() / (m.sum() + 1e-8)
    elif mode == "cispo":
        r = np.exp(np.clip(d, -20, 20))
        cr = np.clip(r, 1 - lo, 1 + hi)
        loss_mat = -cr * adv * lp * wis
        g_mat = -cr * adv * wis
        clipfrac = ((r != cr) & m).sum() / (m.sum() + 1e-8)
    elif mode == "vanilla":
        r = np.exp(np.clip(d, -20, 20))
        l1, l2 = -adv * r, -adv * np.clip(r, 1 - lo, 1 + hi)
        cl1 = np.maximum(l1, l2)
        l3 = -adv * c
        cl2 = np.minimum(l3, cl1)
        loss_mat = np.where(adv < 0, cl2, cl1) * wis
        pick_l1 = l1 >= l2
        g_cl1 = np.where(pick_l1, -adv * r, np.where((r >= 1 - lo) & (r <= 1 + hi), -adv * r, 0.0))
        g_cl2 = np.where(l3 <= cl1, 0.0, g_cl1)  # torch.min tie -> split; no ties in our cases
        g_mat = np.where(adv < 0, g_cl2, g_cl1) * wis
        clipfrac = ((l2 > l1) & m).sum() / (m.sum() + 1e-8)
    loss = float((np.where(m, loss_mat, 0.0) * W).sum())
    grad = np.where(m, g_mat, 0.0) * W
    ppo_kl = float((np.where(m, -d, 0.0)).sum() / (m.sum() + 1e-8))
    return loss, grad, float(clipfrac), ppo_kl


def run_case(name, mode, old, lp, adv, mask, lo, hi, agg, note, clip_ratio_c=3.0, w_is=None):
    cfg = make_config(mode, lo, hi, agg, clip_ratio_c)
    fn = core_algos.get_policy_loss_fn(mode)
    lp_t = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    old_t = torch.tensor(old, dtype=torch.float64)
    adv_t = torch.tensor(adv, dtype=torch.float64)
    mask_t = torch.tensor(mask, dtype=torch.bool)
    w_t = None if w_is is None else torch.tensor(w_is, dtype=torch.float64)
    loss, metrics = fn(
        old_log_prob=old_t,
        log_prob=lp_t,
        advantages=adv_t,
        response_mask=mask_t,
        loss_agg_mode=agg,
        config=cfg,
        rollout_is_weights=w_t,
    )
    assert loss.dtype == torch.float64, loss.dtype
    (g,) = torch.autograd.grad(loss, lp_t)

    # independent check
    r_loss, r_grad, r_cf, r_kl = np_reference(
        mode, np.array(old), np.array(lp), np.array(adv), np.array(mask), lo, hi, agg, clip_ratio_c,
        None if w_is is None else np.array(w_is),
    )
    g_np = g.numpy()
    assert abs(r_loss - loss.item()) < 1e-12 * max(1, abs(r_loss)), (name, r_loss, loss.item())
    assert np.allclose(r_grad, g_np, rtol=1e-10, atol=1e-14), (name, r_grad, g_np)
    assert abs(r_cf - metrics["actor/pg_clipfrac"]) < 1e-12, (name, r_cf, metrics)
    assert abs(r_kl - metrics["actor/ppo_kl"]) < 1e-12, (name, r_kl, metrics)

    out = {
        "policy_loss_mode": mode,
        "note": note,
        "config": {
            "clip_ratio_low": lo,
            "clip_ratio_high": hi,
            "clip_ratio_c": clip_ratio_c,
            "loss_agg_mode": agg,
            "global_batch_info": {},
        },
        "inputs": {
            "log_prob": lp,
            "old_log_prob": old,
            "advantages": adv,
            "response_mask": mask,
            "rollout_is_weights": w_is,
        },
        "outputs": {
            "loss": loss.item(),
            "metrics": {k: float(v) for k, v in metrics.items()},
            "grad_log_prob": g.tolist(),
        },
    }
    if mode == "gspo":
        d = np.array(lp) - np.array(old)
        mk = np.array(mask, dtype=np.float64)
        seq_lr = (d * mk).sum(-1) / np.maximum(mk.sum(-1), 1)
        out["derived_not_from_verl"] = {
            "seq_log_ratio": seq_lr.tolist(),
            "seq_ratio": np.exp(np.minimum(seq_lr, 10.0)).tolist(),
        }
    for v in [out["outputs"]["loss"], *out["outputs"]["metrics"].values(), *np.ravel(out["outputs"]["grad_log_prob"])]:
        assert math.isfinite(v), (name, v)
    return out


def main():
    gspo_lp = add(GSPO_OLD, GSPO_DELTA)
    gspo_adv = bcast(GSPO_ADV_ROW)
    tok_lp = add(TOK_OLD, TOK_DELTA)
    clamp_lp = add(CLAMP_OLD, CLAMP_DELTA)
    cases = {}
    G = ("gspo", GSPO_OLD, gspo_lp, gspo_adv, MASK)
    T = (TOK_OLD, tok_lp, TOK_ADV, MASK)
    cases["gspo_basic"] = run_case(
        "gspo_basic", *G, 3e-4, 4e-4, "seq-mean-token-mean",
        "paper clips; row0 s>1+hi & A>0 (clipped), row1 s<1-lo & A<0 (clipped), row2 s<1-lo & A>0 (unclipped)")
    cases["gspo_wide_clip"] = run_case(
        "gspo_wide_clip", *G, 0.2, 0.28, "seq-mean-token-mean",
        "row0, row2 inside range (unclipped); row1 s<0.8 & A<0 (clipped)")
    cases["gspo_token_mean"] = run_case(
        "gspo_token_mean", *G, 3e-4, 4e-4, "token-mean",
        "verl honours loss_agg_mode for gspo (NOT forced to seq-mean-token-mean)")
    cases["gspo_token_mean_wide"] = run_case(
        "gspo_token_mean_wide", *G, 0.2, 0.28, "token-mean", "token-mean with wide clip")
    cases["gspo_logratio_clamp10"] = run_case(
        "gspo_logratio_clamp10", "gspo", CLAMP_OLD, clamp_lp, bcast(CLAMP_ADV_ROW), MASK, 0.2, 0.28,
        "seq-mean-token-mean",
        "row0 mean log ratio 11 > 10: clamped to exp(10), A<0 so unclipped branch; clamp kills its gradient")
    cases["gspo_rollout_is_weights"] = run_case(
        "gspo_rollout_is_weights", *G, 0.2, 0.28, "seq-mean-token-mean",
        "per-token rollout_is_weights multiply the per-token loss before aggregation", w_is=ROLLOUT_IS_W)
    cases["cispo_basic"] = run_case(
        "cispo_basic", "cispo", *T, 0.2, 0.28, "token-mean",
        "cispo clamps ratio on BOTH sides [1-lo, 1+hi], weight detached; loss value uses raw log_prob")
    cases["cispo_seq_mean"] = run_case(
        "cispo_seq_mean", "cispo", *T, 0.2, 0.28, "seq-mean-token-mean", "same as cispo_basic, seq-mean-token-mean")
    cases["cispo_rollout_is_weights"] = run_case(
        "cispo_rollout_is_weights", "cispo", *T, 0.2, 0.28, "token-mean",
        "per-token rollout_is_weights multiply the per-token loss", w_is=ROLLOUT_IS_W)
    cases["vanilla_basic"] = run_case(
        "vanilla_basic", "vanilla", *T, 0.2, 0.28, "token-mean",
        "dual-clip PPO; row0 token3 ratio e^1.3>3 with A<0 hits clip_ratio_c=3")

    doc = {
        "source": {
            "package": "verl",
            "version": verl.__version__,
            "file": "verl/trainer/ppo/core_algos.py",
            "functions": {
                "gspo": "compute_policy_loss_gspo",
                "cispo": "compute_policy_loss_cispo",
                "vanilla": "compute_policy_loss_vanilla",
            },
            "torch": torch.__version__,
            "dtype": "float64",
            "call": "core_algos.get_policy_loss_fn(mode)(old_log_prob, log_prob, advantages, response_mask(bool), "
            "loss_agg_mode, config=ActorConfig(...), rollout_is_weights)",
        },
        "cases": cases,
    }
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=1)
    for k, v in cases.items():
        print(f"{k:28s} loss={v['outputs']['loss']:+.12e} clipfrac={v['outputs']['metrics']['actor/pg_clipfrac']:.4f}")
    print("wrote", OUT)


if __name__ == "__main__":
    main()
