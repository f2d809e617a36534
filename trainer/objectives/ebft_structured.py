"""rl: ebft with ebft.mode: structured (Axolotl's default): GRPO whose one reward is EBFT's feature matching, as
Axolotl's AxolotlEBFTTrainer (core/trainers/ebft/trainer.py, a GRPOTrainer with _feature_matching_reward; rewards.py
for the pooling and whitening; read 2026-12-08 at 067b021c8b87).

Generation, advantages and the loss are this trainer's GRPO (trainer/objectives/grpo.py) with the trl: block as
Axolotl's EBFT builder passes it (trainer/config/ebft_structured.py). The reward of completion j of a prompt
(rows: `prompt`, `ground_truth`):

1. the prompt rendered as text (chat messages: the chat template with a generation prompt and no
   chat_template_kwargs, as Axolotl's reward renders it), plus the decoded completion -- and once per group plus
   the ground truth -- tokenized without special tokens (truncated at 2048 tokens: Axolotl truncates at its
   training args' max_seq_length, which its RL builder leaves at the default 2048);
2. the frozen feature network (the base with the LoRA adapter disabled, or a frozen copy of the starting model)
   gives the hidden states at layers int(f x num_hidden_layers) for f in ebft.feature_layers (index 0: the
   embeddings), concatenated along the features;
3. pooled per sequence by ebft.embed_method: last_token (the last real token), mean_pooling (every real token),
   completion_mean (the tokens after the prompt), concat (the tokens at len//4, len//2, 3 len//4, concatenated);
4. use_whitening: per prompt, W = U diag(1/s) U^T from the SVD of its completions' embeddings, applied to them and
   to the ground truth's; else each embedding L2-normalised;
5. alignment_j = 2 cos(phi_j, phi_gt), diversity_j = 2 / (n - 1) sum_{j' != j} phi_j . phi_j', reward_j =
   alignment_coef x alignment_j - diversity_coef x diversity_j (paper eq. 7); cfm = ||mean_j phi_j - phi_gt||^2
   per prompt (eq. 2, logged).

ebft.ce_coef is not read in this mode (Axolotl's structured trainer never reads it).
"""

from __future__ import annotations

import contextlib
import json

import torch
import torch.nn.functional as F

from trainer.config.ebft_structured import adaptive, effective_trl
from trainer.errors import DataError
from trainer.objectives import ebft_strided
from trainer.objectives.base import frozen_copy
from trainer.objectives.grpo import GRPO, server_mode

# the reward columns: the feature-matching reward (weight 1: the advantages come from it alone) and, for the logs,
# its parts (weight 0)
COLUMNS = ("feature_matching", "alignment", "diversity", "cfm_loss")
# Axolotl's cap on the feature forward's tokens: its args' max_seq_length, which its RL builder leaves at 2048
MAX_FEATURE_TOKENS = 2048


def pool(hidden, mask, prompt_lengths, method: str):
    """hidden [B, S, D], mask [B, S] (right-padded), prompt_lengths [B] -> [B, D] ([B, 3D] for concat)."""
    lengths = mask.sum(1).long()
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if method == "last_token":
        return hidden[rows, lengths - 1]
    if method == "concat":
        last = hidden.shape[1] - 1
        return torch.cat([hidden[rows, (lengths * k // 4).clamp(0, last)] for k in (1, 2, 3)], dim=-1)
    keep = mask.bool()
    if method == "completion_mean":
        keep = keep & (torch.arange(hidden.shape[1], device=hidden.device)[None] >= prompt_lengths[:, None])
    keep = keep.unsqueeze(-1).to(hidden.dtype)
    return (hidden * keep).sum(1) / keep.sum(1).clamp(min=1)


def feature_rewards(gen, gt, e) -> dict:
    """gen [P, n, D] the completions' embeddings, gt [P, D] the ground truths' -> reward, alignment, diversity
    [P, n] and cfm [P] (whitening or L2 normalisation first, then ebft_strided.block_rewards' formulas)."""
    if e.use_whitening:
        gen, gt = ebft_strided.whiten(gen, gt[:, None])
        gt = gt[:, 0]
    else:
        gen, gt = F.normalize(gen, p=2, dim=-1), F.normalize(gt, p=2, dim=-1)
    r = ebft_strided.block_rewards(gen[:, :, None], gt[:, None], e.model_copy(update={"use_whitening": False}))
    return {"reward": r["reward"][..., 0], "alignment": r["alignment"][..., 0], "diversity": r["diversity"][..., 0],
            "cfm": r["cfm"][:, 0]}


class EBFTStructured(GRPO):
    progress_names = ("reward", "ebft/alignment")

    @classmethod
    def describe(cls, cfg) -> str:
        e, trl = cfg.ebft, effective_trl(cfg.trl)
        where = "the vLLM server" if server_mode(trl) else "model.generate"
        pooled = f"{e.embed_method}{', whitened' if e.use_whitening else ''}"
        return (f"ebft structured ({trl.generations} completions per prompt from {where}, up to "
                f"{trl.completion_length} tokens; beta {trl.kl_beta:g}; reward {e.alignment_coef:g} x alignment - "
                f"{e.diversity_coef:g} x diversity of the hidden states at depths "
                f"{', '.join(f'{f:g}' for f in e.feature_layers)} ({pooled}); feature network: "
                f"{'the base, adapter disabled' if cfg.adapter else 'a frozen copy of the initial model'})")

    @classmethod
    def from_config(cls, cfg, collator, token_loss_sum):
        return cls(cfg, collator)

    @classmethod
    def prepare_data(cls, cfg, tokenizer, rank=0, log=print):
        """Prompts and ground truths through the datasets' transforms (the user's, else Axolotl's structured
        strategies by name: trainer/objectives/ebft_data.py), as GRPO's prompts (trainer/objectives/grpo_data.py)."""
        # heavy: datasets loads only when this runs
        from trainer.objectives.ebft_data import STRUCTURED
        from trainer.objectives.grpo_data import prepare as prepare_prompts

        prepared = prepare_prompts(cfg, tokenizer, log, builtin=STRUCTURED, columns=("prompt", "ground_truth"))
        if any(json.loads(row).get("remaining_turns") for row in prepared.train["row"]):
            raise DataError("datasets: rows with remaining_turns ask for Axolotl's sequential multi-turn rollouts "
                            "(vLLM), not implemented here; use ebft_chat_multiturn.transform_last_turn")
        return prepared

    def __init__(self, cfg, collator):
        trl = effective_trl(cfg.trl).model_copy(update={"reward_funcs": [f"ebft.{c}" for c in COLUMNS],
                                                        "reward_weights": [1.0, 0.0, 0.0, 0.0]})
        super().__init__(cfg.model_copy(update={"trl": trl}), collator, [None] * len(COLUMNS), list(COLUMNS))
        self.e, self.adaptive = cfg.ebft, adaptive(cfg)
        self.feature = self.policy = None
        self.layers: list[int] = []

    def before_training(self, model, *, dtype=None, **kwargs) -> None:
        """GRPO's set-up, then the feature network (as Axolotl's: the base with the adapter disabled, else a frozen
        copy of the starting model) and its layers."""
        super().before_training(model, **kwargs)
        # a full fine-tune with beta > 0 already holds a frozen copy of the starting model (the reference): shared
        self.policy = model
        self.feature = self.ref_model if self.ref_model is not None else frozen_copy(model, dtype)
        config = model.config
        config = getattr(config, "text_config", None) or config
        self.layers = self.e.layer_indices(config.num_hidden_layers)

    def completion_budget(self, examples: list[dict]) -> int:
        """ebft.adaptive_max_tokens (trainer/config/ebft_structured.py adaptive): max(64, the largest
        min(int(ground-truth tokens x gt_length_multiplier), max_completion_length)) over the batch's prompts."""
        budget = self.trl.completion_length
        truths = [json.loads(x["row"]).get("ground_truth") for x in examples] if self.adaptive else []
        counts = [len(self.tokenizer.encode(t, add_special_tokens=False)) for t in truths if t]
        if not counts:
            return budget
        return max(max(min(int(c * self.e.gt_length_multiplier), budget) for c in counts), 64)

    # --- the reward ------------------------------------------------------------------------------------------------
    def prompt_text(self, prompt) -> str:
        if isinstance(prompt, list):
            # start-up: the chat template under its time budget
            from trainer.runtime.templates import render

            return render(self.tokenizer, prompt, tokenize=False, add_generation_prompt=True)
        return prompt

    @torch.no_grad()
    def embed(self, texts: list[str], prompt_texts: list[str]) -> torch.Tensor:
        """[len(texts), D]: each text's pooled feature-layer hidden states (module docstring 1-3)."""
        tok = self.tokenizer
        ids = [tok(t, add_special_tokens=False, truncation=True, max_length=MAX_FEATURE_TOKENS)["input_ids"]
               for t in texts]
        prompts = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompt_texts]
        model = self.feature if self.feature is not None else self.policy
        device = next(model.parameters()).device
        width = max(1, max(map(len, ids)))
        batch = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):
            batch[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        off = contextlib.nullcontext() if self.feature is not None else self.policy.disable_adapter()
        was_training = model.training
        model.eval()
        try:
            with off:
                hidden = model(input_ids=batch.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                               use_cache=False, logits_to_keep=1).hidden_states
        finally:
            model.train(was_training)
        features = torch.cat([hidden[i].float() for i in self.layers], dim=-1)
        return pool(features, mask.to(device), torch.tensor(prompts, device=device), self.e.embed_method)

    def rewards(self, samples: list[dict], step: int) -> torch.Tensor:
        """[N, 4]: each completion's feature-matching reward, alignment, diversity and its group's cfm."""
        rows = [json.loads(s["example"]["row"]) for s in samples]
        prompts = [self.prompt_text(r["prompt"]) for r in rows]
        texts = self.tokenizer.batch_decode([s["completion_ids"] for s in samples], skip_special_tokens=True)
        G = self.G
        gen = self.embed([p + t for p, t in zip(prompts, texts)], prompts)
        gt = self.embed([prompts[k] + (rows[k]["ground_truth"] or "") for k in range(0, len(rows), G)], prompts[::G])
        r = feature_rewards(gen.view(-1, G, gen.shape[-1]), gt, self.e)
        out = torch.stack([r["reward"], r["alignment"], r["diversity"], r["cfm"][:, None].expand(-1, G)], dim=-1)
        out = out.reshape(len(samples), len(COLUMNS)).float().cpu()
        for s, row, t, values in zip(samples, rows, texts, out.tolist()):
            s["prompt"], s["text"], s["rewards"] = row["prompt"], t, values
        return out

    def report(self, sums, totals):
        row = super().report(sums, totals)
        for column, name in zip(COLUMNS, ("reward", "alignment", "diversity", "cfm_loss")):
            row[f"ebft/{name}"] = row.pop(f"rewards/{column}/mean")
            row.pop(f"rewards/{column}/std")
        return row
