"""Energy-Based Fine-Tuning (EBFT, Jelassi et al. 2026, arXiv 2603.12248) in strided mode, as Axolotl integrates it
(src/axolotl/core/trainers/ebft/strided.py, rewards.py; schema: utils/schemas/config.py EBFTConfig).

A document of S tokens gets n_samples_per_prompt rollouts of generate_max_len (G) tokens at each of
num_blocks anchors a_b = anchor + b * stride, all in ONE sequence per rollout set: the document, then the
generated tokens step-major (token s of block b at S + s * num_blocks + b). A strided attention mask lets a
generated token see the document prefix [0, a_b) and the earlier tokens of its own block only; its position id
is a_b + s. A frozen feature network (the base with the LoRA adapter disabled, or a frozen copy of the initial
model for full fine-tuning) embeds the ground-truth block [a_b, a_b + G) and each rollout block; rewards are
alignment (cosine to the ground truth) minus diversity (dot products between rollouts), optionally after SVD
whitening; RLOO advantages weight a REINFORCE loss on the generated tokens, plus ce_coef x cross-entropy.

This module holds the tensor math (mask, positions, rewards, advantages, sampling); the config block and its
rules are trainer/config/ebft.py, the objective (trainer/objectives/ebft.py) runs the forwards, and
trainer/objectives/ebft_data.py holds the dataset transforms.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from trainer.config.ebft import EbftConfig, num_blocks  # noqa: F401 (the layout's block count, checked by config)

# --- the strided layout ---------------------------------------------------------------------------------------

def strided_positions(seq_len: int, anchor: int, stride: int, blocks: int, steps: int):
    """Position ids [seq_len + steps * blocks]: the document 0..S-1, then token s of block b at a_b + s."""
    starts = torch.arange(blocks) * stride + anchor
    gen = (starts[None, :] + torch.arange(steps)[:, None]).flatten()
    return torch.cat([torch.arange(seq_len), gen])


def strided_mask(seq_len: int, anchor: int, stride: int, blocks: int, steps: int, gen_len: int):
    """[L, L] bool (True = attend), L = seq_len + steps * blocks: the document is causal; generated token s of
    block b sees the document before min(a_b, seq_len - gen_len) (Axolotl's clamp, which never binds for
    num_blocks' anchors), itself and its block's earlier tokens (Axolotl's _strided_mask_mod)."""
    L = seq_len + steps * blocks
    q, k = torch.arange(L)[:, None], torch.arange(L)[None, :]
    doc_q, doc_k = q < seq_len, k < seq_len
    step_q, block_q = (q - seq_len) // blocks, (q - seq_len) % blocks
    step_k, block_k = (k - seq_len) // blocks, (k - seq_len) % blocks
    end = (block_q * stride + anchor).clamp(max=seq_len - gen_len)
    return ((doc_q & doc_k & (k <= q)) | (~doc_q & doc_k & (k < end)) | (q == k)
            | (~doc_q & ~doc_k & (block_k == block_q) & (step_k < step_q)))


def predicting_positions(seq_len: int, anchor: int, stride: int, blocks: int, steps: int):
    """[steps * blocks]: for generated token s of block b (in layout order), the position whose logits predict it:
    the token before the anchor (s = 0) or the block's previous generated token.

    Axolotl's loss (strided.py compute_loss) scores position i+1 with the logits at i over the generated region,
    which in the step-major layout is another block's token whenever num_blocks > 1, and spreads each block's
    advantage over gen_len consecutive layout positions (block-major); here each token is scored by the logits
    that sampled it, with its own block's advantage -- the paper's REINFORCE estimator."""
    b = torch.arange(blocks)
    first = anchor + b * stride - 1
    rest = [seq_len + (s - 1) * blocks + b for s in range(1, steps)]
    return torch.cat([first, *rest])


def sample(logits, temperature: float, top_p: float):
    """One token per row of logits [..., V]: greedy at temperature 0, else softmax(logits / T) restricted to the
    smallest set of most likely tokens whose mass reaches top_p (the token crossing top_p is kept)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the more likely tokens
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before > top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1).view(probs.shape[:-1])  # the global RNG: checkpointed, so resume is exact


# --- rewards and advantages -----------------------------------------------------------------------------------

def whiten(gen, gt, tol: float = 1e-5):
    """SVD whitening per group (Axolotl's rewards.py whiten_embeddings_batched, batched over groups):
    gen, gt [groups, n, D]; W = U diag(1/s) U^T from the SVD of each group's gen^T (singular values below
    tol x the largest dropped); returns (gen W, gt W). Axolotl's retry with noise when the SVD fails is not here."""
    u, s, _ = torch.linalg.svd(gen.float().transpose(1, 2), full_matrices=False)  # u [g, D, k], s [g, k]
    inv = torch.where(s > tol * s.amax(-1, keepdim=True), 1.0 / (s + 1e-12), torch.zeros_like(s))
    w = (u * inv[:, None, :]) @ u.transpose(1, 2)
    return (gen.float() @ w).to(gen.dtype), (gt.float() @ w).to(gt.dtype)


def block_rewards(gen, gt, e: EbftConfig) -> dict:
    """gen [B, N, K, D] rollout embeddings, gt [B, K, D] ground-truth embeddings (K blocks per document).
    Axolotl's _compute_block_rewards after pooling: optional whitening per (document, block) over its N rollouts;
    alignment = 2 cos(gen, gt), diversity = 2 mean_{j' != j} gen_j . gen_j' (paper eq 7); reward =
    alignment_coef * alignment - diversity_coef * diversity; cfm = ||mean_j gen_j - gt||^2 (paper eq 2),
    before the factor 2. Returns reward, alignment, diversity [B, N, K] and cfm [B, K]."""
    B, N, K, D = gen.shape
    gt = gt[:, None].expand(B, N, K, D)
    if e.use_whitening:
        g = gen.permute(0, 2, 1, 3).reshape(B * K, N, D)
        t = gt.permute(0, 2, 1, 3).reshape(B * K, N, D)
        g, t = whiten(g, t)
        gen, gt = (x.view(B, K, N, D).permute(0, 2, 1, 3) for x in (g, t))
    alignment = 2 * F.cosine_similarity(gen, gt, dim=-1)
    diversity = torch.zeros_like(alignment)
    if N > 1:
        g = gen.permute(0, 2, 1, 3)  # [B, K, N, D]
        sims = g @ g.transpose(-1, -2)
        sims = sims.masked_fill(torch.eye(N, dtype=torch.bool, device=sims.device), 0.0)
        diversity = 2 * (sims.sum(-1) / (N - 1)).permute(0, 2, 1)
    reward = e.alignment_coef * alignment - e.diversity_coef * diversity
    cfm = ((gen.mean(1) - gt[:, 0]) ** 2).sum(-1)
    return {"reward": reward, "alignment": alignment, "diversity": diversity, "cfm": cfm}


def advantages(rewards, estimator: str):
    """rewards [B, N, K] -> advantages [B, N, K] (Axolotl's _compute_advantages): rloo r_j - mean_{j' != j} r_j',
    group_norm (r - mean) / (std + 1e-8) over the N rollouts, reinforce r."""
    N = rewards.shape[1]
    if estimator == "rloo" and N > 1:
        return rewards - (rewards.sum(1, keepdim=True) - rewards) / (N - 1)
    if estimator == "group_norm" and N > 1:
        return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-8)
    return rewards


def pool(features, method: str):
    """features [..., G, D] of a block's G tokens -> [..., D]: the last token's, or their mean."""
    return features.mean(-2) if method == "mean_pooling" else features[..., -1, :]
