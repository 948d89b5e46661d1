"""The policy-gradient loss math of GRPO and PPO, as pure functions of tensors: the clipped surrogate with dual
clip, the KL to the reference, truncated importance weights, GRPO's group advantage, and how a (B, R) per-token
loss is reduced over a mini-batch whose micro-batches and ranks each see a part of it, and what an update measures
beside its loss. actor.py's update calls them; critic.py's value loss reduces the same way (`agg_loss`). No
optimizer, nothing moved.

    python -m pytest -q tests/test_algo.py          # against hand-computed values and verl's formulas
"""
import torch
import torch.distributed as dist

import ulysses
from model import all_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
STATS = ("pg_loss", "kl", "entropy", "pg_clipfrac", "ppo_kl", "rollout_is/weight_mean", "rollout_is/clipfrac")
IS_STATS = STATS[-2:]                           # reported only with actor.rollout_is=token


# --------------------------------------------------------------------------- reducing a per-token loss
def split(batch: dict, size: int):
    """A batch's mini-batches of `size` rows, in order: one optimizer step each."""
    n = next(iter(batch.values())).shape[0]
    for i in range(0, n, size):
        yield {k: v[i:i + size] for k, v in batch.items()}


def global_counts(mini: dict, sp: int = 1) -> tuple[float, float]:
    """(valid tokens, rows) of a mini-batch over all ranks: the loss denominators. Rows are all of
    them, an empty response (no valid token) included: verl's engine divides the seq-mean modes by
    the global batch size (ppo_mini_batch_size x n), not by the rows that have a token, so an
    empty row lowers the mean instead of being left out of it. `sp`: the k ranks of a Ulysses group
    hold the same rows; each sample counts once (exact: integer counts divided by k)."""
    m = mini["response_mask"]
    c = all_sum(torch.stack([m.sum(), torch.tensor(float(m.shape[0]), device=m.device)]).double())
    c = ulysses.once(c, sp)
    tokens, seqs = c.tolist()                   # one host sync per mini-batch
    return tokens, seqs


def agg_loss(mat: torch.Tensor, mask: torch.Tensor, mode: str, tokens=None, seqs=None) -> torch.Tensor:
    """Reduce a (B, R) per-token loss. `tokens` / `seqs` are the denominators; by default this
    batch's own (sequences: only rows with a valid token, verl's `seq_mask` when it gets no global
    batch size). The update passes the mini-batch's global counts (`global_counts`: over
    micro-batches and ranks, every row for the seq-mean modes, as verl's engine divides by its
    global batch size) so that the gradient does not depend on how the mini-batch is split."""
    mat = mat * mask
    if mode == "token-mean":
        return mat.sum() / (mask.sum() if tokens is None else tokens)
    per_seq = mat.sum(-1)                                          # (B,)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"loss_agg_mode={mode!r}: use one of {LOSS_AGG_MODES}")
    return per_seq.sum() / ((mask.sum(-1) > 0).sum() if seqs is None else seqs)


# --------------------------------------------------------------------------- the policy's loss, GRPO's advantage
def actor_loss(logp: torch.Tensor, ent, mb: dict, cfg, counts: tuple):
    """One micro-batch's loss (clipped PG - entropy bonus + KL) from its log-probs and entropy (B, R), and its
    STATS summed so far (no graph). `cfg`: the actor's config; `counts`: the mini-batch's global (tokens, sequences)."""
    tokens, seqs = counts
    m = mb["response_mask"]
    agg = lambda x: agg_loss(x, m, cfg.loss_agg_mode, tokens, seqs)  # noqa: E731
    old = mb["old_log_probs"] if "old_log_probs" in mb else logp.detach()
    pg_mat, clipped, ratio = policy_loss(logp, old, mb["advantages"], cfg)
    w = torch.ones_like(old)
    if cfg.rollout_is == "token" and "rollout_log_probs" in mb:   # the engine sampled: reweigh to pi_old
        w = truncated_is(old, mb["rollout_log_probs"], cfg.rollout_is_threshold)
        pg_mat = pg_mat * w
    pg, ent_term = agg(pg_mat), agg(ent)
    loss = pg - cfg.entropy_coeff * ent_term
    kl = torch.zeros((), device=logp.device)
    if cfg.use_kl_loss:
        kl = agg(kl_penalty(logp, mb["ref_log_probs"], cfg.kl_loss_type))
        loss = loss + cfg.kl_loss_coef * kl
    with torch.no_grad():
        truncated = torch.exp((old - mb["rollout_log_probs"]).clamp(-20, 20)) > cfg.rollout_is_threshold \
            if "rollout_log_probs" in mb else torch.zeros_like(m, dtype=torch.bool)
        stats = torch.cat([torch.stack([pg, kl, ent_term]), policy_stats(clipped, ratio.detach(), m, tokens),
                           torch.stack([(w * m).sum(), (truncated * m).sum()]) / tokens])
    return loss, stats.double()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from sampled tokens (Schulman's k1/k2/k3)."""
    d = logp - ref_logp
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return 0.5 * d.square()
    if kind in ("low_var_kl", "k3"):           # exp(ref - logp) - (ref - logp) - 1 >= 0
        r = (-d).clamp(-20, 20)
        return (r.exp() - r - 1).clamp(-10, 10)
    raise ValueError(f"kl_loss_type={kind!r}: use one of {KL_TYPES}")


def policy_stats(clipped: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor, tokens) -> torch.Tensor:
    """(pg_clipfrac, ppo_kl) of a micro-batch as shares of a token mean over `tokens` (the mini-batch's global count),
    whatever loss_agg_mode is: summed over micro-batches and ranks, token means, as verl reports them. ppo_kl is
    KL(old || new) per token by k3 = r - 1 - log r (r = new/old; >= 0, low variance); verl logs k1 (can be < 0)."""
    k3 = ratio - 1 - torch.log(ratio)
    return torch.stack([(clipped * mask).sum(), (k3 * mask).sum()]) / tokens


def policy_loss(logp, old_logp, adv, cfg):
    """Clipped surrogate with dual clip, per token (B, R); `cfg`: the actor's config (its clip_ratio_low, _high
    and _c). Returns (loss, clipped-mask, ratio)."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.minimum(clipped, -adv * cfg.clip_ratio_c)    # bounds the loss when A < 0
    loss = torch.where(adv < 0, dual, clipped)
    return loss, (loss2 > loss1).float(), ratio


def truncated_is(old_logp: torch.Tensor, rollout_logp: torch.Tensor, threshold: float) -> torch.Tensor:
    """Token-level truncated importance weights min(pi_old / pi_rollout, C), no gradient: the policy loss carried from
    the engine's distribution (an older policy when async; vLLM's kernels) to the trainer's, its variance bounded."""
    return torch.exp((old_logp - rollout_logp).detach().clamp(-20, 20)).clamp(max=threshold)


def grpo_advantage(scores: torch.Tensor, n: int, mask: torch.Tensor, norm_by_std: bool = True,
                   eps: float = 1e-6) -> torch.Tensor:
    """scores (B,) in groups of n consecutive samples -> advantages (B, R), zero on padding.
    A group of one sample gets mean 0 and std 1, as in verl."""
    g = scores.view(-1, n)                                     # (B/n, n)
    if n == 1:
        mean, std = torch.zeros_like(g), torch.ones_like(g)
    else:
        mean, std = g.mean(-1, keepdim=True), g.std(-1, keepdim=True)   # unbiased std
    adv = (g - mean) / (std + eps) if norm_by_std else g - mean
    return adv.reshape(-1, 1) * mask


# --------------------------------------------------------------------------- what an update measured
def logprob_mismatch(logp: torch.Tensor, batch: dict) -> dict:
    """|trainer log-prob - rollout engine log-prob| over valid tokens, mean and max over all ranks."""
    m = batch["response_mask"]
    d = (logp.detach() - batch["rollout_log_probs"]).abs() * m
    s, mx = torch.stack([d.sum(), m.sum()]).double(), d.max().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(s)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    return {"rollout/logp_diff_mean": (s[0] / s[1]).item(), "rollout/logp_diff_max": mx.item()}


PROBE = 1024                                    # weights per parameter tensor watched for |delta w|


def probe(model) -> torch.Tensor:
    """The first PROBE elements of each local shard, fp32 (a few KB per tensor): how far an update
    moved the weights, without a copy of the model (actor.update_stats reports the mean |delta|)."""
    return torch.cat([p.detach().to_local().reshape(-1)[:PROBE].float() if hasattr(p, "to_local")
                      else p.detach().reshape(-1)[:PROBE].float() for p in model.parameters()])
