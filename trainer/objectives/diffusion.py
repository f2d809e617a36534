"""Diffusion LM training as an objective (the recipe and its sources: trainer/config/diffusion.py).

A step's loss is the mean over the step's sequences (all micro-batches, all ranks) of each sequence's
sum over its masked tokens of cross-entropy / p, divided by its answer-token count: Axolotl's per-sample
loss averaged over the batch, with the step's sequences as the batch.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.batch.attention import FLASH_BACKENDS
from trainer.batch.collate import Collator
from trainer.batch.labels import IGNORE
from trainer.batch.sampler import EVALUATION, MultipackBatchSampler
from trainer.errors import ConfigError
from trainer.objectives.base import Objective
from trainer.objectives.diffusion_steps import bidirectional_mask, sequence_noise
from trainer.parallel.collective import phase
from trainer.parallel.collective import reduce_sum

EVAL_STEP = -1  # the step evaluation draws its noise by: the same masks at every evaluation


class IndexedRows(torch.utils.data.Dataset):
    """Rows of examples, each with its dataset index (the noise of a sequence is keyed by it)."""

    def __init__(self, dataset):
        self.dataset = dataset.select_columns(["input_ids", "labels"])

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, row: list[int]) -> list[dict]:
        return [{**self.dataset[i], "index": i} for i in row]


class Diffusion(Objective):
    name = "diffusion"
    stat_names = ("sequences",)
    metric_names = ("loss_sum", "tokens", "masked", "ce_sum", "correct", "answer_tokens")
    progress_names = ("accuracy",)

    @classmethod
    def from_config(cls, cfg, collator, token_loss_sum):
        return cls(collator, cfg.diffusion, cfg.diffusion.special_ids, cfg.seed)

    def __init__(self, collator: Collator, diffusion, special_ids: list[int], seed: int):
        if collator.attention in FLASH_BACKENDS:
            raise ConfigError(f"diffusion: needs a bidirectional attention mask, which {collator.attention} does not "
                              "take; set attn_implementation: sdpa (as Axolotl's diffusion examples do) or eager")
        if diffusion.mask_token_id is None:
            raise ConfigError("diffusion.mask_token_id: not resolved (the tokenizer was not prepared for diffusion)")
        self.collator = dataclasses.replace(collator, sequence_ids=True)
        self.d, self.special, self.seed = diffusion, torch.tensor(special_ids, dtype=torch.long), seed
        self.step = 0  # set by the loop before each optimizer step

    def rows(self, dataset, reference=None):
        return IndexedRows(dataset)

    def collate(self, rows):
        batch = self.collator(rows)
        batch["attention_mask"] = bidirectional_mask(batch["sequence_ids"], self.collator.attention)
        batch["indices"] = torch.tensor([example["index"] for row in rows for example in row], dtype=torch.long)
        return batch

    def step_stats(self, model, batch):
        return [len(batch["indices"])]

    def noise(self, batch: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(masked [b, s] bool, p [b, s]): which tokens become the mask token, and their mask probability."""
        seq = batch["sequence_ids"].cpu()
        ids, labels = batch["input_ids"].cpu(), batch["labels"].cpu()
        u, p = torch.ones(seq.shape), torch.zeros(seq.shape)
        for s, index in enumerate(batch["indices"].tolist()):
            where = seq == s
            t, draw = sequence_noise(self.seed, step, index, int(where.sum()))
            p[where] = (1 - self.d.eps) * t + self.d.eps
            u[where] = draw
        masked = (u < p) & (labels != IGNORE) & (seq >= 0) & ~torch.isin(ids, self.special)
        device = batch["input_ids"].device
        return masked.to(device), p.to(device)

    def sums(self, model, batch: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum over sequences of their losses, metric vector)."""
        ids, seq, n = batch["input_ids"], batch["sequence_ids"], len(batch["indices"])
        masked, p = self.noise(batch, step)
        noisy = torch.where(masked, torch.full_like(ids, int(self.d.mask_token_id)), ids)
        logits = model(input_ids=noisy, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
                       use_cache=False).logits
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # token i is predicted at position i - 1
        chosen = logits[masked].float()
        targets = ids[masked]
        token_loss = F.cross_entropy(chosen, targets, reduction="none")
        weighted = token_loss / p[masked] if self.d.importance_weighting else token_loss
        answer = (batch["labels"] != IGNORE) & (seq >= 0)
        per_seq = torch.zeros(n, dtype=torch.float32, device=ids.device).index_add(0, seq[masked], weighted)
        lengths = torch.zeros(n, dtype=torch.float32, device=ids.device).index_add(
            0, seq[answer], torch.ones(int(answer.sum()), device=ids.device))
        loss_sum = (per_seq / lengths.clamp(min=1.0)).sum()
        with torch.no_grad():
            correct = (chosen.argmax(-1) == targets).sum()
        values = [loss_sum.detach(), batch["num_tokens"], masked.sum(), token_loss.detach().sum(), correct,
                  answer.sum()]
        return loss_sum, torch.stack([torch.as_tensor(v).double().cpu() for v in values])

    def loss(self, model, batch, totals):
        loss_sum, values = self.sums(model, batch, self.step)
        return loss_sum / max(totals["sequences"], 1), values

    def report(self, sums, totals):
        masked = max(sums["masked"], 1)
        return {"loss": sums["loss_sum"] / max(totals["sequences"], 1), "tokens": int(sums["tokens"]),
                "ce_loss": sums["ce_sum"] / masked, "accuracy": sums["correct"] / masked,
                "mask_ratio": sums["masked"] / max(sums["answer_tokens"], 1), "num_masked_tokens": int(sums["masked"])}

    @torch.no_grad()
    def score(self, model, dataset, where, reference=None) -> dict:
        """The diffusion loss of the validation split with fixed masks (step -1): the same at every evaluation.
        Sharded weights: every rank runs as many forwards as the busiest one (the extra ones are not counted)."""
        device, rank, world, timeout_s = where.device, where.rank, where.world, where.timeout_s
        sampler = MultipackBatchSampler(dataset["length"], where.batch_size, where.capacity, EVALUATION, rank=rank,
                                        world_size=world)
        rows, batches = IndexedRows(dataset), list(sampler)
        steps = len(batches)
        if where.sharded and world > 1:
            most = torch.tensor([steps], device=device)
            with phase("evaluation (counting batches)", rank, timeout_s):
                dist.all_reduce(most, op=dist.ReduceOp.MAX)
            steps = int(most.item())
        was_training = model.training
        model.eval()
        totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, sequences, tokens, masked
        for i in range(steps):
            chosen = batches[i] if i < len(batches) else [[0]]
            batch = {k: v.to(device) for k, v in self.collate([rows[r] for r in chosen]).items()}
            loss_sum, values = self.sums(model, batch, EVAL_STEP)
            if i < len(batches):
                totals += torch.tensor([float(loss_sum), len(batch["indices"]), float(values[1]),
                                        float(values[2])], dtype=torch.float64, device=device)
        reduce_sum(totals, "evaluation (summing eval loss)", rank, timeout_s)
        model.train(was_training)
        loss_sum, sequences, tokens, masked = totals.tolist()
        return {"eval_loss": loss_sum / sequences if sequences else float("nan"), "eval_tokens": int(tokens),
                "eval_num_masked_tokens": int(masked)}

    def describe_eval(self, result: dict) -> str:
        return f"eval_loss {result['eval_loss']:.4f} (diffusion) over {result['eval_tokens']} tokens"
