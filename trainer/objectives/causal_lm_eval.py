"""do_causal_lm_eval: eval_causal_lm_metrics at every evaluation, as Axolotl computes them (its
CausalLMBenchEvalCallback, axolotl/utils/callbacks/__init__.py at 067b021), logged as eval_<metric>.

perplexity (axolotl/utils/callbacks/perplexity.py) is not exp(eval_loss): it decodes each validation example's
trained tokens (the reference answer, special tokens skipped), re-tokenizes all of them as one right-padded batch,
and scores windows of eval_max_new_tokens tokens with stride 512 from the start: the answer alone, without its
prompt, padding included in the loss (no attention mask), as HF's causal-LM loss averages it.

sacrebleu, ter and chrf score greedy generations against the references. Axolotl, for each validation example:
the prompt is its tokens without loss (padding dropped), the reference its tokens with loss, both decoded with
special tokens skipped; the prompt text is tokenized again (the tokenizer's special tokens added) and generated
from with GenerationConfig(max_new_tokens=eval_max_new_tokens, do_sample=False, use_cache=True and the tokenizer's
bos/eos/pad ids); the prediction is the generated tokens decoded with special tokens skipped. It scores them with
`evaluate.load(metric)`, whose scripts (huggingface/evaluate metrics/sacrebleu/sacrebleu.py at 4404a7c, ter/ter.py
and chrf/chrf.py at 2250e67: the copies on GitHub; the Hub's, which evaluate loads, were not reachable) call the
sacrebleu package with one reference per prediction and their defaults:
`sacrebleu.corpus_bleu(predictions, [references])` (tokenize 13a, smooth_method exp), `TER().corpus_score(...)`
(case-insensitive, as evaluate's default case_sensitive=False), `CHRF().corpus_score(...)` (char order 6, word
order 0, beta 2); Axolotl logs each result's "score". The same calls are made here, on the sacrebleu package.

Two differences, both where Axolotl's output depends on how prompts happen to be batched: prompts are batched
eval_batch_size at a time and LEFT-padded with an attention mask (Axolotl pads with the tokenizer's side, right
for most, and generates after the padding), and the prediction is exactly the new tokens (Axolotl cuts each row at
the length of its prompt's original tokens, which keeps pieces of the prompt or drops generated tokens wherever
decoding, re-tokenizing and padding changed that length). Each evaluation's generations are appended to
output_dir/eval_generations.jsonl ({step, prompt, prediction, reference}; Axolotl shows none), kept as
metrics.jsonl is: a new run starts it empty, a resumed one cuts it back to its checkpoint's step.

comet (Unbabel's unbabel-comet package and its Unbabel/wmt22-comet-da model, downloaded from the Hugging Face
Hub when evaluate loads it) is not computed: listed, it is refused by the config; in the default list
(eval_causal_lm_metrics unset: sacrebleu, comet, ter, chrf) it is left out with a note, as Axolotl itself leaves
it out with a warning where unbabel-comet is not installed (it is not one of Axolotl's dependencies).

Every rank generates and scores the whole validation split (the same forwards everywhere, generation kept in step
across ranks with synced_gpus, so sharded weights are safe); the main rank writes the generations.
"""

from __future__ import annotations

from typing import Callable

import torch
from trainer.batch.labels import IGNORE
from trainer.config.training import CAUSAL_LM_DEFAULT as DEFAULT
from trainer.config.training import SACREBLEU_METRICS as GENERATED  # scored on greedy generations
from trainer.errors import ConfigError

STRIDE = 512
SUPPORTED = ("perplexity", *GENERATED)
GENERATIONS = "eval_generations.jsonl"
INSTALL_HINT = "pip install 'envtool-llm[eval]' (sacrebleu)"


def references(validation, tokenizer) -> list[str]:
    return [tokenizer.decode([t for t, lab in zip(ids, labels) if lab != IGNORE], skip_special_tokens=True)
            for ids, labels in zip(validation["input_ids"], validation["labels"])]


def perplexity(model, tokenizer, texts: list[str], max_seq_len: int, device, chunk: int = 16) -> float:
    """Axolotl's Perplexity.compute over `texts`; rows are fed `chunk` at a time (the loss is a token mean over
    the same fixed window of columns, so chunking rows gives the one-batch value)."""
    with torch.no_grad():
        return _perplexity(torch, model, tokenizer, texts, max_seq_len, device, chunk)


def _perplexity(torch, model, tokenizer, texts, max_seq_len, device, chunk) -> float:
    was_training = model.training
    model.eval()
    input_ids = tokenizer(texts, return_tensors="pt", padding=True, truncation=True)["input_ids"]
    length = input_ids.size(1)
    losses, prev_end = [], 0
    for begin in range(0, length, STRIDE):
        end = min(begin + max_seq_len, length)
        target = end - prev_end
        window = input_ids[:, begin:end]
        labels = window.clone()
        labels[:, :-target] = IGNORE
        total, count = 0.0, 0
        for i in range(0, window.size(0), chunk):
            ids, lab = window[i:i + chunk].to(device), labels[i:i + chunk].to(device)
            logits = model(input_ids=ids).logits.float()
            shifted = lab[:, 1:]
            total += torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), shifted.reshape(-1),
                                                       ignore_index=IGNORE, reduction="sum").item()
            count += int((shifted != IGNORE).sum())
        losses.append(total / count)
        prev_end = end
        if end == length:
            break
    model.train(was_training)
    return float(torch.exp(torch.tensor(losses).mean()))


def prompts_and_references(validation, tokenizer) -> tuple[list[str], list[str]]:
    """Axolotl's split of each example: the tokens without loss (padding dropped) are the prompt, the tokens with
    loss the reference, each decoded with special tokens skipped."""
    pad = tokenizer.pad_token_id
    prompts = [[t for t, lab in zip(ids, labels) if lab == IGNORE and t != pad]
               for ids, labels in zip(validation["input_ids"], validation["labels"])]
    return tokenizer.batch_decode(prompts, skip_special_tokens=True), references(validation, tokenizer)


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int, device) -> list[str]:
    """Greedy completions of `prompts` (texts, tokenized again as Axolotl does), `batch_size` at a time, left-padded."""
    # heavy: transformers loads only when this runs
    from transformers import GenerationConfig

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = GenerationConfig(max_new_tokens=max_new_tokens, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=pad, do_sample=False, use_cache=True)
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else pad
    dist = torch.distributed
    synced = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1  # every rank, every step
    was_training, out = model.training, []
    model.eval()
    try:
        for begin in range(0, len(prompts), batch_size):
            # (a prompt with no tokens, where every token is trained, starts from the bos token, or the pad token)
            encoded = [tokenizer(text)["input_ids"] or [start] for text in prompts[begin:begin + batch_size]]
            width = max(len(ids) for ids in encoded)
            ids = torch.tensor([[pad] * (width - len(row)) + row for row in encoded], device=device)
            mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in encoded], device=device)
            with torch.no_grad():
                sequences = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                           synced_gpus=synced)
            out += tokenizer.batch_decode(sequences[:, width:].tolist(), skip_special_tokens=True)
    finally:
        model.train(was_training)
    return out


def score(metric: str, predictions: list[str], refs: list[str]) -> float:
    """evaluate's metric script for `metric`, as Axolotl calls it: one reference per prediction, the defaults."""
    # optional: sacrebleu is installed where the plan asks for it (the causal_lm_eval feature)
    import sacrebleu

    scorer = {"sacrebleu": sacrebleu.BLEU, "ter": sacrebleu.TER, "chrf": sacrebleu.CHRF}[metric]()
    return float(scorer.corpus_score(predictions, [refs]).score)


class CausalLMMetrics:
    def __init__(self, cfg, tokenizer, open_log: Callable | None):
        """open_log(file name): the JSON-lines log the generations are appended to (the run's own kind: a new run
        starts it empty, a resumed one cuts it back to its checkpoint's step; written by the main rank)."""
        self.metrics = list(cfg.eval_causal_lm_metrics or DEFAULT)
        self.max_new_tokens, self.tokenizer = cfg.eval_max_new_tokens, tokenizer
        self.batch_size = cfg.eval_batch_size or cfg.micro_batch_size
        scored = [m for m in self.metrics if m in GENERATED]
        if scored:  # before the first step, not at the first evaluation
            try:
                # optional: sacrebleu is installed where the plan asks for it (the causal_lm_eval feature)
                import sacrebleu  # noqa: F401
            except ImportError:
                raise ConfigError(f"eval_causal_lm_metrics: {', '.join(scored)} need the sacrebleu package, which is "
                                  "not installed in this environment; install the eval extra: "
                                  f"{INSTALL_HINT}") from None
        self.log = open_log(GENERATIONS) if open_log is not None and scored else None

    def __call__(self, model, validation, device, step: int) -> dict:
        prompts, refs = prompts_and_references(validation, self.tokenizer)
        predictions = None
        if any(m in GENERATED for m in self.metrics):
            predictions = generate(model, self.tokenizer, prompts, self.max_new_tokens, self.batch_size, device)
            self.write(step, prompts, predictions, refs)
        return {f"eval_{m}": perplexity(model, self.tokenizer, refs, self.max_new_tokens, device)
                if m == "perplexity" else score(m, predictions, refs) for m in self.metrics}

    def write(self, step: int, prompts: list[str], predictions: list[str], refs: list[str]) -> None:
        if self.log is not None:
            for prompt, prediction, reference in zip(prompts, predictions, refs):
                self.log.write({"step": step, "prompt": prompt, "prediction": prediction, "reference": reference})


def metrics(cfg, tokenizer, open_log: Callable | None = None) -> CausalLMMetrics | None:
    """do_causal_lm_eval: more metrics at every evaluation (None without it)."""
    return CausalLMMetrics(cfg, tokenizer, open_log) if cfg.do_causal_lm_eval else None
