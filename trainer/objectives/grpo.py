"""GRPO and GDPO (rl: grpo / gdpo): online RL on completions the policy generates, as TRL 1.16's GRPOTrainer.

Per optimizer step each process takes micro_batch_size x gradient_accumulation_steps / num_generations prompts
(TRL's generation batch: micro_batch_size x accumulation completions per process), and:

1. generates num_generations completions per prompt with the policy (eval mode, no grad; sampling with
   temperature, top_p, top_k, min_p, repetition_penalty, up to max_completion_length new tokens). The sampling
   RNG is seeded from (seed, step, the prompt's index) inside a forked RNG, so a resumed run draws the same
   completions, the number of processes does not change them, and the training RNG is untouched;
2. scores them with the reward functions (TRL's signature: prompts, completions, completion_ids, columns);
   None is NaN (left out of the statistics; a completion every function skipped gets advantage 0);
3. turns rewards into advantages (TRL's _generate_and_score_completions):
   sum_then_normalize (GRPO): r = sum_k w_k r_k; A = r - mean_group(r), divided by std_group(r) + 1e-4
     (scale_rewards group / true), by the std of the whole batch (batch), or not at all (none / false);
   normalize_then_sum (GDPO, rl: gdpo's default): each r_k normalised within its group,
     (r_k - mean_group) / (std_group + 1e-4), summed with the weights, then normalised over the whole batch.
   Batch statistics are over all processes (one all-reduce of three numbers);
4. splits the step's completions into gradient_accumulation_steps micro-batches of micro_batch_size; the loop
   then computes each micro-batch's loss in train mode (TRL's _compute_loss):
     ratio = exp(logp - logp_old) (logp_old = logp detached: one update per generation batch),
     per-token loss = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) + beta KL,
     KL = (exp(ref - logp) - (ref - logp) - 1) x ratio (per token, against the reference; the ratio factor,
     TRL's use_bias_correction_kl, is 1 in value but carries the gradient of logp),
   aggregated by loss_type: dapo (TRL's default) sums over the step's completion tokens on all processes and
   divides by their count; grpo averages each completion over its tokens, then over the step's completions;
   bnpo divides each micro-batch's sum by its tokens, then averages micro-batches; dr_grpo divides the sum by
   completions x max_completion_length. Log-probs are of logits / temperature, as TRL's.

With trl.use_vllm + vllm_lora_sync (trainer/objectives/grpo_server.py) the completions of 1. come from a vLLM server
over HTTP instead, the adapter synced to it first (Axolotl's rule; async_prefetch: requested a step ahead), and the loss's clipped term is weighed by
Axolotl's importance-sampling correction (the trainer's over the server's probability of each sampled token:
`importance_ratio`; on by default, token_truncate, cap 3).

trl.off_policy_mask_threshold (TRL's off-policy sequence mask, `off_policy_mask`) zeroes the clipped term of a
completion with a negative advantage whose mean KL from the sampling distribution (the server's log-probs; without a
server the policy's own, so nothing is masked at a threshold >= 0) is above the threshold.

The reference (beta > 0 only) is the starting model: with LoRA the base with the adapter disabled (no copy),
for a full fine-tune a frozen copy taken before any step (and before a checkpoint's weights load); with
trl.sync_ref_model the policy is mixed into that copy every ref_model_sync_steps steps
(trainer/objectives/grpo_ref_sync.py).
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass

import numpy as np
import torch

from trainer.errors import ConfigError
from trainer.errors import TrainingError
from trainer.objectives.base import ExampleRows, Objective, frozen_copy
from trainer.parallel.collective import barrier, reduce_sum

EPS = 1e-4  # TRL's
EVAL_STEP = -1  # the step the evaluation's sampling RNG is keyed by (the same prompts draw alike at every evaluation)


@dataclass(frozen=True)
class LossSettings:
    """TRL's GRPO loss settings: the KL coefficient `beta`, the clip range (1 - eps_low, 1 + eps_high), the importance
    sampling `level` (token or sequence) and use_bias_correction_kl."""

    beta: float
    eps_low: float
    eps_high: float
    level: str = "token"
    bias_correction_kl: bool = True


def importance_ratio(logps, sampling_logps, mask, mode: str, cap: float):
    """Axolotl's vLLM importance-sampling correction (AsyncGRPOTrainer, core/trainers/grpo/async_trainer.py): the ratio
    of the trainer's probability of each sampled token to the server's, exp(logp - logp_vllm) per token (token_*) or
    per completion (sequence_*: summed over its tokens); *_truncate clamps it to [1/cap, cap], *_mask zeroes it above
    cap and raises it to at least 1/cap. A token the server gave no log-prob for (NaN) counts as ratio 1, as TRL's.
    [B, T] or [B, 1]; no gradient."""
    diff = torch.nan_to_num(((logps - sampling_logps) * mask).detach(), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio.clamp(min=1.0 / cap, max=cap)
    return ratio.masked_fill(ratio > cap, 0.0).clamp(min=1.0 / cap)


def off_policy_mask(advantages, logps, sampling_logps, mask, threshold: float):
    """trl.off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence mask, as TRL 1.16's
    GRPOTrainer.get_off_policy_mask: [B, 1], 0 where a completion's advantage is negative and its mean per-token
    KL(sampling || policy) = mean(sampling_logp - logp) over its tokens is above the threshold, else 1. A token the
    server gave no log-prob for (NaN) counts as KL 0, as TRL's. No gradient."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    kl = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (mean_kl <= threshold)).to(dtype=mask.dtype)


def grpo_per_token_loss(logps, old_logps, ref_logps, advantages, mask, settings: LossSettings, is_ratio=None,
                        keep=None):
    """(per-token loss [B, T] (or [B, 1] at sequence level without KL), per-token KL or None, clipped [B, T]).
    keep (the off-policy sequence mask) and is_ratio (vLLM's importance-sampling correction) weigh the clipped
    term, in that order, before the KL is added (TRL's order)."""
    beta, eps_low, eps_high = settings.beta, settings.eps_low, settings.eps_high
    level, bias_correction_kl = settings.level, settings.bias_correction_kl
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = logps - old_logps
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if keep is not None:
        per_token = per_token * keep
    if is_ratio is not None:
        per_token = per_token * is_ratio
    kl = None
    if beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if bias_correction_kl:  # TRL's use_bias_correction_kl (default true): importance-weighted, with its gradient
            kl = kl * coef_1
        per_token = per_token + beta * kl
    clipped = ((coef_1 < 1 - eps_low) & (adv < 0)) | ((coef_1 > 1 + eps_high) & (adv > 0))
    return per_token, kl, clipped


def aggregate(per_token, mask, loss_type: str, totals: dict, max_completion_length: int):
    """This micro-batch's share of the step's loss (summed over micro-batches and processes it is the loss)."""
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / max(totals["completions"], 1)
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / max(totals["micro_batches"], 1)
    if loss_type == "dr_grpo":
        return masked.sum() / (max(totals["completions"], 1) * max_completion_length)
    return masked.sum() / max(totals["completion_tokens"], 1)  # dapo


def _moments(x: torch.Tensor, rank: int, timeout: float, world: bool):
    """nanmean and TRL's nanstd (Bessel-corrected) of x over all processes (world) or this one."""
    x = x.double()
    ok = ~torch.isnan(x)
    v = torch.stack([x[ok].sum(), (x[ok] ** 2).sum(), ok.sum().double()])
    if world:
        v = reduce_sum(v, "GRPO (batch reward statistics)", rank, timeout)
    s, sq, n = v.tolist()
    if n == 0:
        return float("nan"), float("nan")
    mean = s / n
    var = max(sq / n - mean * mean, 0.0) * (n / (n - 1)) if n > 1 else float("nan")
    return mean, var ** 0.5


def _group_std(g: torch.Tensor, dim: int = 1) -> torch.Tensor:
    mean = torch.nanmean(g, dim=dim, keepdim=True)
    n = (~torch.isnan(g)).sum(dim=dim, keepdim=True)
    var = torch.nanmean((g - mean) ** 2, dim=dim, keepdim=True) * (n / (n - 1))
    return var.sqrt()


def compute_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                       aggregation: str, scaling: str, batch_moments=None):
    """(advantages [N], zero-std flags [N]) from rewards [N, F] (NaN: no reward), groups of num_generations
    consecutive completions. batch_moments(x) -> (mean, std) over the whole batch (all processes)."""
    batch_moments = batch_moments or (lambda x: _moments(x, 0, 0, False))
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        grouped = rewards.view(-1, num_generations)
        mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
        if scaling == "batch":
            std = torch.full_like(rewards, batch_moments(rewards)[1])
        else:
            std = _group_std(grouped).squeeze(1).repeat_interleave(num_generations)
        advantages = rewards - mean
        if scaling != "none":
            advantages = advantages / (std + EPS)
    else:  # normalize_then_sum (GDPO)
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        reward_k = ((grouped - mean_k) / (_group_std(grouped) + EPS)).view(-1, rewards_per_func.shape[1])
        rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean, std_value = batch_moments(rewards)
        std = torch.full_like(rewards, std_value)
        advantages = (rewards - mean) / (std + EPS)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), zero_std


def server_mode(trl) -> bool:
    """Completions from a vLLM server with the adapter synced through the filesystem (else model.generate)."""
    return bool(trl.use_vllm and trl.vllm_lora_sync)


class GRPO(Objective):
    stat_names = ("completions", "completion_tokens", "micro_batches")
    progress_names = ("reward", "kl")

    @classmethod
    def describe(cls, cfg) -> str:
        trl = cfg.trl
        where = ""
        if server_mode(trl):
            # start-up: grpo_server imports only the standard library at its top
            from trainer.objectives.grpo_server import base_url

            where = (f"; completions from the vLLM server at {base_url(trl)}, the adapter synced every "
                     f"{trl.vllm_sync_interval or 1} step(s){', the next step prefetched' if trl.async_prefetch else ''}")
        if trl.sync_ref_model:
            where += f"; the reference synced every {trl.sync_steps} steps (alpha {trl.mixup_alpha:g})"
        if trl.off_policy_mask_threshold is not None:
            where += f"; off-policy sequences masked above KL {trl.off_policy_mask_threshold:g}"
        return (f"{cfg.rl} ({trl.generations} completions per prompt, up to {trl.completion_length} tokens; "
                f"beta {trl.kl_beta:g}; rewards {', '.join(trl.reward_funcs)}{where})")

    @classmethod
    def from_config(cls, cfg, collator, token_loss_sum):
        # heavy: torch loads only when this runs
        from trainer.objectives.grpo_data import reward_functions

        funcs = reward_functions(cfg)
        return cls(cfg, collator, funcs, [getattr(f, "__name__", n) for f, n in zip(funcs, cfg.trl.reward_funcs)])

    @classmethod
    def prepare_data(cls, cfg, tokenizer, rank=0, log=print):
        """Prompts through the user's transforms, prepared in memory by every process, never cached
        (trainer/objectives/grpo_data.py says why)."""
        # heavy: torch loads only when this runs
        from trainer.objectives.grpo_data import prepare as prepare_prompts

        return prepare_prompts(cfg, tokenizer, log)

    @classmethod
    def check_services(cls, cfg) -> None:
        """The vLLM server answers before the model loads, or the run stops in one line (use_vllm + vllm_lora_sync)."""
        if server_mode(cfg.trl):
            # heavy: requests loads only when this runs
            from trainer.objectives.grpo_server import base_url, server_timeout, wait_for_server

            wait_for_server(base_url(cfg.trl), server_timeout(cfg.trl))

    def __init__(self, cfg, collator, reward_funcs: list, reward_names: list[str]):
        trl = cfg.trl
        self.name = cfg.rl
        self.trl, self.cfg = trl, cfg
        self.funcs, self.reward_names = reward_funcs, reward_names
        self.weights = torch.tensor(trl.weights, dtype=torch.float32)
        self.G, self.beta = trl.generations, trl.kl_beta
        self.loss_type = trl.loss_type or "dapo"
        self.aggregation = trl.multi_objective_aggregation or (
            "normalize_then_sum" if cfg.rl == "gdpo" else "sum_then_normalize")
        self.pad_id = collator.pad_token_id
        self.seed, self.step = cfg.seed, 0
        self.metric_names = ("loss", "tokens", "completions", "completion_tokens", "kl_sum", "clipped",
                             "truncated", "zero_std", "reward_sum", "reward_sq", "reward_n",
                             *[f"{n}/{k}" for n in reward_names for k in ("sum", "sq", "n")])
        self.server = None  # trainer.objectives.grpo_server.ServerGeneration (use_vllm + vllm_lora_sync)
        self.correction = None  # (mode, cap) of the importance-sampling correction of server completions
        if server_mode(trl):
            if trl.vllm_importance_sampling_correction is not False:  # Axolotl's defaults: on, token_truncate, 3.0
                self.correction = (trl.vllm_importance_sampling_mode or "token_truncate",
                                   trl.vllm_importance_sampling_cap or 3.0)
                self.metric_names += ("is_ratio_sum", "is_ratio_n")
        self.tokenizer = self.ref_model = None
        self.rank, self.timeout, self.output_dir, self.say = 0, 1800.0, None, print

    # --- the loop's hooks ---------------------------------------------------------------------------------
    def loader_batch(self, micro_batch_size: int, ga: int) -> tuple[int, int]:
        """Prompts per loader batch, loader batches per step: one generation batch per optimizer step."""
        return micro_batch_size * ga // self.G, 1

    def before_training(self, model, *, tokenizer, rank: int, timeout: float, output_dir, say, **_) -> None:
        """The reference (beta > 0): the base with the adapter off (LoRA), else a frozen copy of the starting model."""
        self.tokenizer, self.rank, self.timeout, self.output_dir, self.say = tokenizer, rank, timeout, output_dir, say
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_ids = ([tokenizer.eos_token_id] if tokenizer.eos_token_id not in eos else []) + eos
        if server_mode(self.trl):  # before the first step: a server that does not answer is one line, now
            # heavy: requests and trl load only when this runs
            from trainer.objectives.grpo_server import ServerGeneration

            self.server = ServerGeneration(self.cfg, rank, say)
            say(f"{self.name}: {self.server.describe()}")
            if self.trl.async_prefetch:
                say(f"{self.name}: async_prefetch: each next step's completions are generated on the server while "
                    "this step trains (one step stale; the importance-sampling correction weighs them)")
        if self.beta != 0.0 and not hasattr(model, "disable_adapter"):
            self.ref_model = frozen_copy(model)
            say(f"{self.name}: beta {self.beta:g} with a full fine-tune keeps a frozen copy of the starting model "
                "as the reference (LoRA needs none: its reference is the base with the adapter disabled)")

    def rows(self, dataset, reference=None):
        return ExampleRows(dataset, ["prompt_ids", "row", "index"])

    def collate(self, rows):
        return {"examples": [example for row in rows for example in row]}

    def lengths(self, dataset):
        return np.asarray(dataset["length"])

    # --- generation and rewards (once per step, no grad) --------------------------------------------------
    def generation_config(self):
        # heavy: transformers loads only when this runs
        from transformers import GenerationConfig

        trl = self.trl
        settings = {"max_new_tokens": trl.completion_length, "do_sample": True, "pad_token_id": self.pad_id,
                    "bos_token_id": self.tokenizer.bos_token_id, "eos_token_id": self.eos_ids,
                    "temperature": trl.temperature or 1.0, "top_p": trl.top_p or 1.0, "top_k": trl.top_k or 0,
                    "min_p": trl.min_p, "repetition_penalty": trl.repetition_penalty or 1.0}
        # trl.generation_kwargs over them, as TRL's GRPOTrainer updates its generation_kwargs
        return GenerationConfig(**{**settings, **(trl.generation_kwargs or {})}, num_return_sequences=self.G)

    def completion_budget(self, examples: list[dict]) -> int:
        """New tokens allowed to this generation batch's completions (structured EBFT narrows it per batch)."""
        return self.trl.completion_length

    def trim(self, ids: list[int]) -> tuple[list[int], bool]:
        """(ids up to and with the first end-of-sequence token, truncated: no such token)."""
        end = next((i for i, t in enumerate(ids) if t in self.eos_ids), None)
        return (ids, True) if end is None else (ids[:end + 1], False)

    def generate_on_server(self, examples: list[dict], step: int) -> list[dict]:
        """The same completions' shape from the vLLM server (prompt-major, num_generations each), with the server's
        log-probs of the sampled tokens (for the importance-sampling correction)."""
        if not examples:
            return []
        seed = ((self.seed * 1_000_003 + step) * 1_000_033 + examples[0]["index"]) % 2**31
        got = self.server.generate([e["prompt_ids"] for e in examples], self.G, self.completion_budget(examples), seed)
        ids, logprobs = got["completion_ids"], got.get("logprobs")
        if len(ids) != len(examples) * self.G:
            raise TrainingError(f"trl.use_vllm: the vLLM server returned {len(ids)} completions for {len(examples)} "
                                f"prompts x {self.G} generations")
        out = []
        for k, completion in enumerate(ids):
            kept, truncated = self.trim(list(completion))
            sample = {"example": examples[k // self.G], "completion_ids": kept, "truncated": truncated}
            if logprobs is not None:
                sample["sampling_logps"] = [float("nan") if lp[0] is None else lp[0] for lp in logprobs[k][:len(kept)]]
            out.append(sample)
        return out

    def server_samples(self, model, examples: list[dict], step: int) -> list[dict]:
        """This step's completions from the server: prefetched while the previous step trained (async_prefetch), else
        generated now; between the two the adapter is synced when due; then (async_prefetch) the next step's
        completions are requested in the background (trainer/objectives/grpo_server.py)."""
        server = self.server
        samples = server.take((step, tuple(e["index"] for e in examples)))
        server.maybe_sync(model, step, lambda: barrier("vLLM adapter sync", self.rank, self.timeout))
        if samples is None:
            samples = self.generate_on_server(examples, step)
        following = self.upcoming() if self.trl.async_prefetch and self.upcoming is not None else None
        if following:
            ahead = [e for b in following for e in b["examples"]]
            server.prefetch((step + 1, tuple(e["index"] for e in ahead)),
                            lambda: self.generate_on_server(ahead, step + 1))
        return samples

    @torch.no_grad()
    def generate(self, model, examples: list[dict], step: int) -> list[dict]:
        """num_generations completions per prompt, trimmed after the first end-of-sequence token."""
        if self.server is not None:
            return self.generate_on_server(examples, step)
        device = next(model.parameters()).device
        config = self.generation_config()
        if "max_new_tokens" not in (self.trl.generation_kwargs or {}):
            config.max_new_tokens = self.completion_budget(examples)
        out = []
        devices = [device] if device.type == "cuda" else []
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=devices):
                for example in examples:
                    torch.manual_seed((self.seed * 1_000_003 + step) * 1_000_033 + example["index"])
                    prompt = torch.tensor([example["prompt_ids"]], device=device)
                    generated = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                               generation_config=config)[:, prompt.shape[1]:].tolist()
                    for ids in generated:
                        kept, truncated = self.trim(ids)
                        out.append({"example": example, "completion_ids": kept, "truncated": truncated})
        finally:
            model.train(was_training)
        return out

    def rewards(self, samples: list[dict], step: int) -> torch.Tensor:
        rows = [json.loads(s["example"]["row"]) for s in samples]
        prompts = [row["prompt"] for row in rows]
        texts = self.tokenizer.batch_decode([s["completion_ids"] for s in samples], skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                       for p, t in zip(prompts, texts)]
        columns = {k: [row.get(k) for row in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}
        state = types.SimpleNamespace(global_step=step, max_steps=None)
        out = torch.zeros(len(samples), len(self.funcs))
        for k, (func, name) in enumerate(zip(self.funcs, self.reward_names)):
            try:
                values = func(prompts=prompts, completions=completions,
                              completion_ids=[s["completion_ids"] for s in samples], trainer_state=state, **columns)
                values = [float("nan") if v is None else float(v) for v in values]
            except Exception as err:
                raise TrainingError(f"trl.reward_funcs: {name} failed at step {step + 1}: "
                                    f"{type(err).__name__}: {err}") from None
            if len(values) != len(samples):
                raise TrainingError(f"trl.reward_funcs: {name} returned {len(values)} rewards for {len(samples)} "
                                    "completions (one per completion is expected)")
            out[:, k] = torch.tensor(values)
        for s, p, t, r in zip(samples, prompts, texts, out.tolist()):
            s["prompt"], s["text"], s["rewards"] = p, t, r
        return out

    def expand(self, model, loader_batches: list[dict], ga: int, world: bool) -> list[dict]:
        """The step's micro-batches: generate, score, compute advantages and (beta > 0) reference log-probs."""
        step = self.step
        examples = [e for b in loader_batches for e in b["examples"]]
        samples = self.server_samples(model, examples, step) if self.server is not None else (
            self.generate(model, examples, step))
        rewards = self.rewards(samples, step)
        advantages, zero_std = compute_advantages(
            rewards, self.weights, self.G, self.aggregation, self.trl.scaling,
            batch_moments=lambda x: _moments(x, self.rank, self.timeout, world))
        for s, a, z in zip(samples, advantages.tolist(), zero_std.tolist()):
            s["advantage"], s["zero_std"] = a, z
        if self.trl.log_completions and self.rank == 0 and (step + 1) % self.cfg.logging_steps == 0:
            self.log_completions(samples, step + 1)
        per = len(samples) // ga
        device = next(model.parameters()).device
        batches = [self.tensors(samples[i * per:(i + 1) * per], device) for i in range(ga)]
        if self.beta != 0.0:
            for batch in batches:
                batch["ref_logps"] = self.reference_logps(model, batch)
        return batches

    def tensors(self, samples: list[dict], device) -> dict:
        """Rows of prompt + completion, right-padded; completion positions, mask, advantages, rewards."""
        seqs = [s["example"]["prompt_ids"] + s["completion_ids"] for s in samples]
        width = max(map(len, seqs))
        longest = max(len(s["completion_ids"]) for s in samples)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(seqs), width), dtype=torch.long)
        positions = torch.zeros((len(seqs), longest), dtype=torch.long)
        mask = torch.zeros((len(seqs), longest), dtype=torch.float32)
        sampling = torch.zeros((len(seqs), longest), dtype=torch.float32) if "sampling_logps" in samples[0] else None
        for b, (seq, s) in enumerate(zip(seqs, samples)):
            if sampling is not None:
                sampling[b, :len(s["sampling_logps"])] = torch.tensor(s["sampling_logps"], dtype=torch.float32)
            ids[b, :len(seq)] = torch.tensor(seq)
            attention[b, :len(seq)] = 1
            p, c = len(s["example"]["prompt_ids"]), len(s["completion_ids"])
            positions[b] = torch.arange(p - 1, p - 1 + longest).clamp(max=width - 2)
            if not (self.trl.mask_truncated_completions and s["truncated"]):
                mask[b, :c] = 1.0
        extra = {} if sampling is None else {"sampling_logps": sampling.to(device)}
        return {**extra, "input_ids": ids.to(device), "attention_mask": attention.to(device),
                "positions": positions.to(device), "completion_mask": mask.to(device),
                "advantages": torch.tensor([s["advantage"] for s in samples], device=device),
                "rewards": torch.tensor([s["rewards"] for s in samples], dtype=torch.float64),
                "truncated": float(sum(s["truncated"] for s in samples)),
                "zero_std": float(sum(s["zero_std"] for s in samples)),
                "lengths": float(sum(len(s["completion_ids"]) for s in samples))}

    def token_logps(self, model, batch) -> torch.Tensor:
        """log p(completion token) under logits / temperature, [B, longest completion]."""
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        pos = batch["positions"]
        picked = logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
        picked = picked / (self.trl.temperature or 1.0)
        targets = batch["input_ids"].gather(1, (pos + 1).clamp(max=batch["input_ids"].shape[1] - 1))
        return torch.log_softmax(picked, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    @torch.no_grad()
    def reference_logps(self, model, batch) -> torch.Tensor:
        if self.ref_model is not None:
            return self.token_logps(self.ref_model, batch)
        was_training = model.training
        model.eval()  # as TRL: the reference pass runs without dropout
        try:
            with model.disable_adapter():
                return self.token_logps(model, batch)
        finally:
            model.train(was_training)

    # --- the loss -----------------------------------------------------------------------------------------
    def step_stats(self, model, batch):
        return [float(batch["input_ids"].shape[0]), float(batch["completion_mask"].sum()), 1.0]

    def loss(self, model, batch, totals):
        trl, mask = self.trl, batch["completion_mask"]
        logps = self.token_logps(model, batch)
        is_ratio = keep = None
        if self.correction is not None and "sampling_logps" in batch:
            is_ratio = importance_ratio(logps, batch["sampling_logps"], mask, *self.correction)
        if trl.off_policy_mask_threshold is not None:  # TRL: the sampling log-probs (the server's), else the old ones
            keep = off_policy_mask(batch["advantages"], logps, batch.get("sampling_logps", logps.detach()), mask,
                                   trl.off_policy_mask_threshold)
        per_token, kl, clipped = grpo_per_token_loss(
            logps, logps.detach(), batch.get("ref_logps"), batch["advantages"], mask,
            LossSettings(self.beta, trl.eps_low, trl.eps_high, trl.importance_sampling_level or "token",
                         trl.use_bias_correction_kl is not False), is_ratio, keep)
        loss = aggregate(per_token, mask, self.loss_type, totals, trl.completion_length)
        rewards = batch["rewards"]
        weighted = (rewards * self.weights.double().unsqueeze(0)).nansum(dim=1)
        weighted[torch.isnan(rewards).all(dim=1)] = torch.nan
        ok = ~torch.isnan(weighted)
        values = [loss.detach(), float(batch["attention_mask"].sum()), float(rewards.shape[0]), batch["lengths"],
                  float((kl.detach() * mask).sum()) if kl is not None else 0.0,
                  float((clipped.float().expand_as(mask) * mask).sum()), batch["truncated"], batch["zero_std"],
                  float(weighted[ok].sum()), float((weighted[ok] ** 2).sum()), float(ok.sum())]
        for k in range(rewards.shape[1]):
            col = rewards[:, k]
            good = ~torch.isnan(col)
            values += [float(col[good].sum()), float((col[good] ** 2).sum()), float(good.sum())]
        if self.correction is not None:
            weights = mask if is_ratio is None or is_ratio.shape[-1] == mask.shape[-1] else mask.amax(-1, keepdim=True)
            ratio = torch.ones_like(weights) if is_ratio is None else is_ratio
            values += [float((ratio * weights).sum()), float(weights.sum())]
        return loss, torch.tensor([float(v) for v in values], dtype=torch.float64)

    def report(self, sums, totals):
        n = max(sums["completions"], 1)

        def mean_std(prefix):
            count = sums[f"{prefix}_n" if prefix == "reward" else f"{prefix}/n"]
            s = sums[f"{prefix}_sum" if prefix == "reward" else f"{prefix}/sum"]
            sq = sums[f"{prefix}_sq" if prefix == "reward" else f"{prefix}/sq"]
            if not count:
                return float("nan"), float("nan")
            mean = s / count
            std = (max(sq / count - mean * mean, 0.0) * count / (count - 1)) ** 0.5 if count > 1 else float("nan")
            return mean, std

        row = {"loss": sums["loss"], "tokens": int(sums["tokens"])}
        row["reward"], row["reward_std"] = mean_std("reward")
        for name in self.reward_names:
            row[f"rewards/{name}/mean"], row[f"rewards/{name}/std"] = mean_std(name)
        row["frac_reward_zero_std"] = sums["zero_std"] / n
        row["completions/mean_length"] = sums["completion_tokens"] / n
        row["completions/clipped_ratio"] = sums["truncated"] / n
        masked_tokens = max(totals["completion_tokens"], 1)
        if self.beta != 0.0:
            row["kl"] = sums["kl_sum"] / masked_tokens
        row["clip_ratio/region_mean"] = sums["clipped"] / masked_tokens
        row["completions"] = int(sums["completions"])
        if self.correction is not None and sums["is_ratio_n"]:  # TRL's and Axolotl's metric name
            row["sampling/importance_sampling_ratio/mean"] = sums["is_ratio_sum"] / sums["is_ratio_n"]
        return row

    def log_completions(self, samples: list[dict], step: int) -> None:
        """A small rich table of the first num_completions_to_print completions; all of rank 0's go to
        output_dir/completions.jsonl."""
        if self.output_dir is not None:
            with open(self.output_dir / "completions.jsonl", "a") as f:
                for s in samples:
                    f.write(json.dumps({"step": step, "prompt": s["prompt"], "completion": s["text"],
                                        **dict(zip(self.reward_names, s["rewards"])),
                                        "advantage": s["advantage"]}, default=str) + "\n")
        shown = samples[: self.trl.num_completions_to_print if self.trl.num_completions_to_print is not None else len(samples)]
        if not shown:
            return
        # start-up: rich imported only when this runs
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"completions at step {step}", show_lines=True)
        for column in ("prompt", "completion", *self.reward_names, "advantage"):
            table.add_column(column)
        for s in shown:
            prompt = s["prompt"][-1]["content"] if isinstance(s["prompt"], list) else s["prompt"]
            table.add_row(str(prompt)[-200:], s["text"][:400], *[f"{r:.2f}" for r in s["rewards"]], f"{s['advantage']:.2f}")
        Console(stderr=True).print(table)

    # --- evaluation: the held-out prompts as one step, no grad ---------------------------------------------
    @torch.no_grad()
    def score(self, model, dataset, where, reference=None) -> dict:
        """Each rank generates for its share of the validation prompts (every world-th), with the sampling RNG keyed
        by (seed, EVAL, prompt index); rewards, advantages, the loss and its metrics as for a training step, over
        the whole split on all processes (three fixed-size all-reduces)."""
        if self.tokenizer is None:
            raise ConfigError(f"evaluate: rl: {self.name} evaluates while training (eval_ rows in metrics.jsonl, "
                              "with val_set_size); this command does not generate")
        device, rank, world, timeout_s, batch_size = where.device, where.rank, where.world, where.timeout_s, where.batch_size
        mine = [dataset[i] for i in range(rank, len(dataset), world)]
        if self.server is not None:
            self.server.settle()  # the next step's prefetch finishes first (one request at a time)
        samples = self.generate(model, mine, EVAL_STEP)
        rewards = self.rewards(samples, EVAL_STEP) if samples else torch.zeros(0, len(self.funcs))
        advantages, zero_std = compute_advantages(
            rewards, self.weights, self.G, self.aggregation, self.trl.scaling,
            batch_moments=lambda x: _moments(x, rank, timeout_s, world > 1))
        for s, a, z in zip(samples, advantages.tolist(), zero_std.tolist()):
            s["advantage"], s["zero_std"] = a, z
        was_training = model.training
        model.eval()
        batches = [self.tensors(samples[i:i + batch_size], device) for i in range(0, len(samples), batch_size)]
        stats = torch.zeros(len(self.stat_names), dtype=torch.float64, device=device)
        for batch in batches:
            if self.beta != 0.0:
                batch["ref_logps"] = self.reference_logps(model, batch)
            stats += torch.tensor(self.step_stats(model, batch), dtype=torch.float64, device=device)
        totals = dict(zip(self.stat_names, reduce_sum(stats, "evaluation (summing eval totals)", rank, timeout_s).tolist()))
        sums = torch.zeros(len(self.metric_names), dtype=torch.float64, device=device)
        for batch in batches:
            sums += self.loss(model, batch, totals)[1].to(device)
        sums = reduce_sum(sums, "evaluation (summing eval metrics)", rank, timeout_s)
        model.train(was_training)
        report = self.report(dict(zip(self.metric_names, sums.tolist())), totals)
        return {f"eval_{k}": v for k, v in report.items()}

    def describe_eval(self, result: dict) -> str:
        return (f"eval_reward {result['eval_reward']:.4f} over {result['eval_completions']} completions "
                f"(eval_loss {result['eval_loss']:.4f})")
