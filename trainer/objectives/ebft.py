"""rl: ebft in strided mode as an objective (the method, its sources and the tensor math: trainer/objectives/ebft_strided.py).

Per micro-batch of documents: sample n rollouts at every anchor with the current policy (no grad, eval mode:
no dropout while sampling -- Axolotl samples in train mode), embed ground truth and rollouts with the frozen
feature network, turn rewards into RLOO advantages, then one forward with grad over the whole strided layout:

    loss = rl_coef * sum(-log pi(token) * A_block) / action tokens + ce_coef * sum(-log pi(doc token)) / ce tokens

The divisors are the step's totals (all micro-batches, all ranks). Axolotl takes each micro-batch's mean and
averages micro-batches; its rows are all padded to sequence_len, so every micro-batch has the same counts and
the two agree. Sampling draws from the global torch RNG, which checkpoints save and restore: resume is exact.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

from trainer.batch.labels import IGNORE
from trainer.errors import ConfigError
from trainer.objectives import ebft_strided
from trainer.objectives.base import Objective, frozen_copy


class DocumentRows(torch.utils.data.Dataset):
    def __init__(self, dataset):
        columns = [c for c in ("input_ids", "labels", "prompt_length") if c in dataset.column_names]
        self.dataset = dataset.select_columns(columns)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, row: list[int]) -> list[dict]:
        return [self.dataset[i] for i in row]


@contextlib.contextmanager
def sdpa(*models):
    """EBFT's forwards take an explicit [b, 1, L, L] bool mask: run them with sdpa whatever backend the model
    was loaded with (Axolotl switches to flex_attention block masks on GPUs and eager dense masks elsewhere --
    the same attention pattern)."""
    configs = [m.config for m in models if m is not None]
    saved = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = "sdpa"
    try:
        yield
    finally:
        for c, s in zip(configs, saved):
            c._attn_implementation = s


class EBFT(Objective):
    name = "ebft"
    stat_names = ("action_tokens", "ce_tokens")
    metric_names = ("rl_sum", "ce_sum", "reward_sum", "alignment_sum", "diversity_sum", "cfm_sum", "groups",
                    "rollouts", "adv_sum", "adv_sq", "blocks", "micro_batches", "tokens")
    progress_names = ("ebft/mean_reward",)

    @classmethod
    def describe(cls, cfg) -> str:
        e = cfg.ebft
        return (f"ebft strided ({e.n_samples_per_prompt} rollouts of {e.generate_max_len} tokens every {e.stride} "
                f"tokens from {e.context_length}; feature network: "
                f"{'the base, adapter disabled' if cfg.adapter else 'a frozen copy of the initial model'})")

    @classmethod
    def from_config(cls, cfg, collator, token_loss_sum):
        return cls(cfg, collator.pad_token_id)

    @classmethod
    def prepare_data(cls, cfg, tokenizer, rank=0, log=print):
        """Documents through the config's transforms (trainer/objectives/ebft_data.py); the transforms' source
        files are part of the cache key, so editing one re-tokenizes."""
        # heavy: torch loads only when this runs
        from trainer.data.prepare import prepare
        from trainer.objectives.ebft_data import build_ebft, identity

        return prepare(cfg, tokenizer, rank, log, builder=build_ebft,
                       kind={"kind": "ebft", "ebft_transforms": identity(cfg)})

    def __init__(self, cfg, pad_token_id: int):
        self.e: ebft_strided.EbftConfig = cfg.ebft
        self.pad = pad_token_id
        self.feature = None  # the frozen copy (full fine-tune); None with LoRA (the base with the adapter off)

    # --- the model --------------------------------------------------------------------------------------------
    def before_training(self, model, *, dtype=None, **_) -> None:
        """The feature network is the initial model. With an adapter: the same weights with the adapter disabled
        (no copy); else a frozen copy in the training precision (Axolotl deep-copies too, in bf16; fp32 training
        on CPU keeps fp32)."""
        self.feature = frozen_copy(model, dtype)

    def features(self, policy, ids, mask, positions, layers: list[int]) -> torch.Tensor:
        """Per token, each feature layer's hidden state L2-normalised, concatenated: [b, L, len(layers) * H]."""
        model = self.feature if self.feature is not None else policy
        off = contextlib.nullcontext() if self.feature is not None else policy.disable_adapter()
        was_training = model.training
        model.eval()
        with off, torch.no_grad():
            hidden = model(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True,
                           use_cache=False).hidden_states
        model.train(was_training)
        return torch.cat([F.normalize(hidden[i].float(), p=2, dim=-1) for i in layers], dim=-1)

    # --- data --------------------------------------------------------------------------------------------------
    def lengths(self, dataset) -> np.ndarray:
        return np.asarray(dataset["length"])

    def rows(self, dataset, reference=None):
        return DocumentRows(dataset)

    def collate(self, rows):
        docs = [example for row in rows for example in row]
        width = max(len(d["input_ids"]) for d in docs)
        ids = torch.full((len(docs), width), self.pad, dtype=torch.long)
        labels = torch.full((len(docs), width), IGNORE, dtype=torch.long)
        for i, d in enumerate(docs):
            ids[i, :len(d["input_ids"])] = torch.tensor(d["input_ids"])
            labels[i, :len(d["labels"])] = torch.tensor(d["labels"])
        if all("prompt_length" in d for d in docs):  # ebft_strided_structured's column
            prompt = torch.tensor([int(d["prompt_length"]) for d in docs])
            structured = True
        else:  # Axolotl derives it from the labels: the first trained token (all -100: the whole row)
            trained = labels != IGNORE
            prompt = torch.where(trained.any(1), trained.float().argmax(1), torch.tensor(width)).long()
            structured = bool(prompt.min() > 0)
        e = self.e
        anchor = max(int(prompt.max()) + e.min_completion_prefix, e.context_length) if structured else e.context_length
        blocks = ebft_strided.num_blocks(width, e.generate_max_len, anchor, e.stride)
        return {"input_ids": ids, "labels": labels, "anchor": anchor, "blocks": blocks, "structured": structured,
                "num_tokens": sum(len(d["input_ids"]) for d in docs)}

    def ce_mask(self, batch) -> torch.Tensor:
        """[B, S-1]: the document next-token predictions CE is taken on (structured: the completion's tokens;
        else every document token, as Axolotl's ~action_mask)."""
        if batch["structured"]:
            return batch["labels"][:, 1:] != IGNORE
        return torch.ones_like(batch["input_ids"][:, 1:], dtype=torch.bool)

    def step_stats(self, model, batch):
        B, n, blocks = batch["input_ids"].shape[0], self.e.n_samples_per_prompt, max(batch["blocks"], 0)
        ce = float(self.ce_mask(batch).sum()) * n if self.e.ce_coef > 0 and blocks > 0 else 0.0
        return [B * n * blocks * self.e.generate_max_len, ce]

    # --- the loss ----------------------------------------------------------------------------------------------
    def layout(self, S: int, anchor: int, blocks: int, steps: int, rows: int, device):
        e = self.e
        mask = ebft_strided.strided_mask(S, anchor, e.stride, blocks, steps, e.generate_max_len).to(device)
        positions = ebft_strided.strided_positions(S, anchor, e.stride, blocks, steps).to(device)
        L = mask.shape[0]
        return mask[None, None].expand(rows, 1, L, L), positions[None].expand(rows, L)

    @torch.no_grad()
    def generate(self, policy, docs, anchor: int, blocks: int) -> torch.Tensor:
        """[B*n, S + G * blocks]: the documents, then the rollouts' tokens step-major (no KV cache: each step
        runs the whole layout so far, as Axolotl's _generate_strided_blocks)."""
        e, S = self.e, docs.shape[1]
        seqs = docs
        was_training = policy.training
        policy.eval()
        for step in range(e.generate_max_len):
            mask, positions = self.layout(S, anchor, blocks, step, seqs.shape[0], seqs.device)
            logits = policy(input_ids=seqs, attention_mask=mask, position_ids=positions, use_cache=False).logits
            where = ebft_strided.predicting_positions(S, anchor, e.stride, blocks, step + 1)[-blocks:].to(seqs.device)
            seqs = torch.cat([seqs, ebft_strided.sample(logits[:, where], e.temperature, e.top_p)], dim=1)
        policy.train(was_training)
        return seqs

    def loss(self, model, batch, totals):
        e = self.e
        policy = getattr(model, "module", model)  # DDP's module: generation and features need no gradient sync
        ids, anchor, blocks = batch["input_ids"], batch["anchor"], batch["blocks"]
        B, S, n, G = *ids.shape, e.n_samples_per_prompt, e.generate_max_len
        if blocks <= 0:  # too short for one anchor (Axolotl: zero loss); still a graph, for DDP's hooks
            with sdpa(policy):
                zero = model(input_ids=ids, use_cache=False).logits.sum() * 0.0
            return zero, torch.zeros(len(self.metric_names), dtype=torch.float64)
        docs = ids.repeat_interleave(n, dim=0)
        with sdpa(policy, self.feature):
            seqs = self.generate(policy, docs, anchor, blocks)
            mask, positions = self.layout(S, anchor, blocks, G, B * n, ids.device)
            layers = e.layer_indices(policy.config.num_hidden_layers)
            feats = self.features(policy, seqs, mask, positions, layers)
            logits = model(input_ids=seqs, attention_mask=mask, position_ids=positions, use_cache=False).logits
        D = feats.shape[-1]
        gt = feats[:, anchor:S].unfold(1, G, e.stride)[:, :blocks].transpose(-1, -2)  # [B*n, K, G, D]
        gen = feats[:, S:].reshape(B * n, G, blocks, D).transpose(1, 2)  # [B*n, K, G, D]
        gt = ebft_strided.pool(gt, e.embed_method).view(B, n, blocks, D)[:, 0]
        gen = ebft_strided.pool(gen, e.embed_method).view(B, n, blocks, D)
        r = ebft_strided.block_rewards(gen, gt, e)
        adv = ebft_strided.advantages(r["reward"], e.estimator).reshape(B * n, blocks)

        where = ebft_strided.predicting_positions(S, anchor, e.stride, blocks, G).to(ids.device)
        logps = torch.log_softmax(logits[:, where].float(), dim=-1).gather(-1, seqs[:, S:, None]).squeeze(-1)
        token_adv = adv.repeat(1, G)  # layout order: step-major, block b at b, K + b, ...
        rl_sum = -(logps * token_adv).sum()
        loss = e.rl_coef * rl_sum / max(totals["action_tokens"], 1)
        ce_sum = torch.zeros((), device=ids.device)
        if e.ce_coef > 0:
            keep = self.ce_mask(batch).repeat_interleave(n, dim=0)
            doc_logps = torch.log_softmax(logits[:, :S - 1].float(), dim=-1).gather(-1, seqs[:, 1:S, None]).squeeze(-1)
            ce_sum = -(doc_logps * keep).sum()
            loss = loss + e.ce_coef * ce_sum / max(totals["ce_tokens"], 1)
        values = [rl_sum.detach(), ce_sum.detach(), r["reward"].sum(), r["alignment"].sum(), r["diversity"].sum(),
                  r["cfm"].sum(), B * blocks, B * n * blocks, adv.sum(), (adv ** 2).sum(), blocks, 1,
                  batch["num_tokens"]]
        return loss, torch.stack([torch.as_tensor(v).double().cpu() for v in values])

    def report(self, sums, totals):
        e = self.e
        rl = sums["rl_sum"] / max(totals["action_tokens"], 1)
        ce = sums["ce_sum"] / max(totals["ce_tokens"], 1)
        m, groups = max(sums["rollouts"], 1), max(sums["groups"], 1)
        var = (sums["adv_sq"] - sums["adv_sum"] ** 2 / m) / max(m - 1, 1)
        return {"loss": e.rl_coef * rl + e.ce_coef * ce, "tokens": int(sums["tokens"]),
                "ebft/rl_loss": rl, "ebft/ce_loss": ce, "ebft/cfm_loss": sums["cfm_sum"] / groups,
                "ebft/mean_reward": sums["reward_sum"] / m, "ebft/alignment": sums["alignment_sum"] / m,
                "ebft/diversity": sums["diversity_sum"] / m, "ebft/advantages_std": max(var, 0.0) ** 0.5,
                "ebft/num_blocks": sums["blocks"] / max(sums["micro_batches"], 1)}

    def score(self, model, dataset, where, reference=None):
        raise ConfigError("rl: ebft has no evaluation loss here (set val_set_size: 0)")
