"""do_causal_lm_eval with eval_causal_lm_metrics: [perplexity], as Axolotl computes it
(axolotl/utils/callbacks/perplexity.py, called by its CausalLMBenchEvalCallback at every evaluation).

Axolotl's "perplexity" is not exp(eval_loss): it decodes each validation example's trained tokens (the
reference answer, special tokens skipped), re-tokenizes all of them as one right-padded batch, and scores
windows of eval_max_new_tokens tokens with stride 512 from the start: the answer alone, without its prompt,
padding included in the loss (no attention mask), as HF's causal-LM loss averages it. Logged as
eval_perplexity. Every rank computes the same value over the whole split (the same forwards everywhere, so
sharded weights are safe).

Axolotl's other metrics (sacrebleu, comet, ter, chrf: its default list) compare greedy generations with the
references through the `evaluate` package's metric scripts, which it downloads from the Hugging Face Hub;
they are refused by the config (trainer.config), not skipped.
"""

from __future__ import annotations


import torch
from trainer.batch.labels import IGNORE

STRIDE = 512
SUPPORTED = ("perplexity",)


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


class CausalLMMetrics:
    def __init__(self, cfg, tokenizer):
        self.metrics, self.max_new_tokens, self.tokenizer = cfg.eval_causal_lm_metrics, cfg.eval_max_new_tokens, tokenizer

    def __call__(self, model, validation, device) -> dict:
        texts = references(validation, self.tokenizer)
        return {"eval_perplexity": perplexity(model, self.tokenizer, texts, self.max_new_tokens, device)}


def metrics(cfg, tokenizer) -> CausalLMMetrics | None:
    """do_causal_lm_eval: more metrics at every evaluation (None without it)."""
    return CausalLMMetrics(cfg, tokenizer) if cfg.do_causal_lm_eval else None
