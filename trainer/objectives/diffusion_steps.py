"""The tensor side of diffusion LM training (trainer/config/diffusion.py holds its config and rules, which config
validation imports without torch): each sequence's noise, the bidirectional mask, and Axolotl's sampling."""

from __future__ import annotations


from pathlib import Path
import json
import numpy as np
import torch

from trainer.config.diffusion import DiffusionConfig
from trainer.hooks import Hook


def sequence_noise(seed: int, step: int, index: int, length: int) -> tuple[float, torch.Tensor]:
    """(t, u[length]) for one sequence: t picks its mask probability, token j is masked where u[j] < p."""
    key = np.random.SeedSequence([seed, step + 1, index]).generate_state(2, dtype=np.uint32)
    g = torch.Generator().manual_seed(int(key[0]) << 32 | int(key[1]))
    t = float(torch.rand(1, generator=g))
    return t, torch.rand(length, generator=g)


def bidirectional_mask(segments: torch.Tensor, attention: str) -> torch.Tensor:
    """[batch, 1, seq, seq]: tokens attend to every token of their own sequence, both ways (padding only to
    padding, so no query row is empty). sdpa takes bools; eager adds 0 / min-float to its scores."""
    allowed = (segments[:, :, None] == segments[:, None, :])[:, None]
    if attention == "eager":
        return torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return allowed


def pick_samples(dataset, d: DiffusionConfig, generator: torch.Generator) -> list[tuple[list[int], list[int]]]:
    """Axolotl's _sample_sequences_from_dataloader, with our own generator: num_generation_samples examples of
    at least 10 tokens, cut to generation_max_length keeping the prompt and as much answer as fits."""
    out = []
    for i in torch.randperm(len(dataset), generator=generator).tolist():
        if len(out) == d.num_generation_samples:
            break
        ids, labels = dataset[i]["input_ids"], dataset[i]["labels"]
        if len(ids) < 10:
            continue
        cap = min(len(ids), d.generation_max_length)
        answer = [j for j, label in enumerate(labels) if label != -100]
        if not answer:
            continue
        prompt = answer[0]
        take = min(sum(1 for j in answer if j >= prompt), cap - prompt)
        if take <= 0:
            continue
        out.append((ids[:prompt + take], labels[:prompt + take]))
    return out


@torch.no_grad()
def generate(model, ids: list[int], labels: list[int], d: DiffusionConfig, attention: str,
             generator: torch.Generator) -> tuple[list[int], list[bool]]:
    """Axolotl's generate() for one sequence: mask every answer token (or, when all tokens are answer, a random
    10-70% of them), then generation_steps reverse steps, each unmasking the most confident predictions
    (1 / steps left of the masked tokens, at least one; temperature > 0 samples with Gumbel noise)."""
    device = next(model.parameters()).device
    original = torch.tensor([ids], device=device)
    answer = torch.tensor([[label != -100 for label in labels]], device=device)
    if answer.any() and not answer.all():
        masked = answer
    else:
        ratio = float(torch.rand(1, generator=generator)) * 0.6 + 0.1
        positions = torch.randperm(len(ids), generator=generator)[:max(1, int(len(ids) * ratio))]
        masked = torch.zeros_like(original, dtype=torch.bool)
        masked[0, positions.to(device)] = True
    mask_id = int(d.mask_token_id)
    sequence = torch.where(masked, torch.full_like(original, mask_id), original)
    attention_mask = bidirectional_mask(torch.zeros_like(original), attention).to(device)
    for step in range(d.generation_steps):
        current = sequence == mask_id
        if not current.any():
            break
        logits = model(input_ids=sequence, attention_mask=attention_mask, use_cache=False).logits.float()
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)[current]
        if d.generation_temperature > 0:
            logits = logits / d.generation_temperature
        logits[:, mask_id] = -float("inf")
        if d.generation_temperature > 0:
            u = torch.rand(logits.shape, generator=generator).to(device)
            predicted = torch.argmax(logits - torch.log(-torch.log(u)), dim=-1)
        else:
            predicted = torch.argmax(logits, dim=-1)
        confidence = torch.softmax(logits, dim=-1)[torch.arange(len(predicted)), predicted]
        remaining = int(current.sum())
        count = remaining if step == d.generation_steps - 1 else max(1, int(remaining / (d.generation_steps - step)))
        if count >= remaining:
            sequence[current] = predicted
        else:
            top = confidence.topk(count).indices
            sequence[0, torch.where(current)[1][top]] = predicted[top]
    return sequence[0].tolist(), masked[0].tolist()


def write_samples(run: Run, model, tokenizer, dataset, attention: str, step: int) -> int:
    """generate_samples (run.cfg.diffusion): every generation_interval steps, samples from the validation split
    (else the training data) are regenerated and appended to output_dir/samples.jsonl ({step, original, masked, generated,
    masked_tokens, total_tokens, original_ids, generated_ids}). A private generator keyed by (seed, step) picks and samples them, so
    training (and its RNG, for exact resume) is untouched. Returns the number written."""
    d, seed, output_dir, log = run.cfg.diffusion, run.cfg.seed, run.output_dir, run.say
    key = np.random.SeedSequence([seed, step, 7]).generate_state(1, dtype=np.uint32)
    generator = torch.Generator().manual_seed(int(key[0]))
    was_training = model.training
    model.eval()
    rows = []
    try:
        for ids, labels in pick_samples(dataset, d, generator):
            generated, masked = generate(model, ids, labels, d, attention, generator)
            shown = [d.mask_token_id if m else t for t, m in zip(ids, masked)]
            rows.append({"step": step, "original": tokenizer.decode(ids, skip_special_tokens=True),
                         "masked": tokenizer.decode(shown, skip_special_tokens=False),
                         "generated": tokenizer.decode(generated, skip_special_tokens=True),
                         "masked_tokens": sum(masked), "total_tokens": len(ids), "original_ids": ids,
                         "generated_ids": generated})
    finally:
        model.train(was_training)
    with open(Path(output_dir) / "samples.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for r in rows:
        log(f"step {step}: sample ({r['masked_tokens']}/{r['total_tokens']} masked): {r['generated']!r}")
    return len(rows)


class Samples(Hook):
    """generate_samples in the loop: every generation_interval steps, by rank 0 alone."""

    def __init__(self, run: Run, model, tokenizer, dataset, attention: str):
        self.run, self.model, self.tokenizer, self.dataset, self.attention = run, model, tokenizer, dataset, attention

    def after_step(self, step: int) -> None:
        if step % self.run.cfg.diffusion.generation_interval == 0:
            write_samples(self.run, self.model, self.tokenizer, self.dataset, self.attention, step)


def hook(run: Run, model, tokenizer, data, attention: str, sharded: bool) -> Hook | None:
    """Samples on rank 0 only, so not where every forward is a collective (sharded weights, tensor parallel)."""
    cfg, say = run.cfg, run.say
    if cfg.diffusion is None or not cfg.diffusion.generate_samples:
        return None
    if sharded:
        say("note: diffusion.generate_samples: no samples with sharded weights (each forward is a collective)")
        return None
    dataset = data.validation if data.validation is not None else data.train
    return Samples(run, model, tokenizer, dataset, attention) if run.main else None
