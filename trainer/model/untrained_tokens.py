"""fix_untrained_tokens: the embedding rows of tokens a base model never trained, set to the mean of the trained rows
before training, as Axolotl does it (its LGPL contrib of unsloth's fix, called from axolotl/train.py once the model
and the tokenized training rows are ready). Written here from what that fix does:

- a row is untrained where its input-embedding row is all <= 1e-16 and its output-embedding (lm_head) row is too, or
  repeats (rounded to 3 decimals) the lm_head row of another such token; the pad token never is. A list value adds its
  token ids to those found (`true` or one id: only those found, as Axolotl passes only a list on).
- nothing changes unless one of them is in the chat template's text or in the first or last 250 training rows;
- then, where the embeddings are not trained (an adapter), the run stops: training them untrained gives NaNs (Axolotl
  raises the same);
- else each of them the training rows use gets, in both matrices, the mean of the rows not found untrained (the
  sum over all rows less theirs, over the count of rows not found) times its count in the rows over the most
  frequent token's count; a token the rows never use is left as it is.
"""

from __future__ import annotations

from collections import Counter

import torch

from trainer.errors import ConfigError

EPS = 1e-16
SCAN = 250  # rows looked at, from each end, before anything is counted


def _found(inputs: torch.Tensor, outputs: torch.Tensor, pad: int | None) -> list[int]:
    flat = inputs.amax(dim=1) <= EPS
    rows = torch.where(flat)[0].tolist()
    rounded = [tuple(r) for r in outputs[rows].float().cpu().numpy().round(3).tolist()]
    repeated = {r for r, n in Counter(rounded).items() if n >= 2}
    untrained = (outputs.amax(dim=1) <= EPS) & flat
    for i, r in zip(rows, rounded):
        if r in repeated:
            untrained[i] = True
    if pad is not None and pad < untrained.shape[0]:
        untrained[pad] = False
    return torch.where(untrained)[0].tolist()


def _ids(rows, i: int) -> list[int]:
    row = rows[i]
    return list(row["input_ids"]) if "input_ids" in row else []


def _every_row(rows):
    if "input_ids" not in (getattr(rows, "column_names", None) or []):
        return
    for batch in rows.iter(batch_size=1024):
        yield from batch["input_ids"]


def fix(cfg, model, tokenizer, train_rows, say) -> None:
    """Set the untrained rows (module docstring) in place, before the model is wrapped for training."""
    if not cfg.fix_untrained_tokens or train_rows is None:
        return
    inputs, outputs = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    width = min(inputs.shape[1], outputs.shape[1])  # a vision model's input rows can be wider
    with torch.no_grad():
        found = _found(inputs[:, :width], outputs[:, :width], tokenizer.pad_token_id)
        extra = cfg.fix_untrained_tokens if isinstance(cfg.fix_untrained_tokens, list) else []
        candidates = sorted(set(found) | set(extra))
        if not candidates:
            say("fix_untrained_tokens: the base has no untrained embedding rows; none changed")
            return
        names = [t for t in tokenizer.convert_ids_to_tokens(candidates) if t is not None]
        template = getattr(tokenizer, "chat_template", None) or ""
        wanted = set(candidates)
        n = len(train_rows)
        ends = list(range(min(n, SCAN))) + list(range(max(n - SCAN, 0), n))
        in_rows = [t for i in ends for t in _ids(train_rows, i) if t in wanted]
        if not in_rows and not (isinstance(template, str) and any(t in template for t in names)):
            say(f"fix_untrained_tokens: {len(candidates)} untrained token(s) in the base, none in the training rows' "
                "ends or the chat template; none changed (as Axolotl)")
            return
        if not (inputs.requires_grad and outputs.requires_grad):
            if not in_rows:  # (Axolotl looks further, 2000 rows from each end, before it stops)
                ends = list(range(min(n, 2000))) + list(range(max(n - 2000, 0), n))
                in_rows = [t for i in ends for t in _ids(train_rows, i) if t in wanted]
            if in_rows:
                raise ConfigError(f"fix_untrained_tokens: the untrained tokens {sorted(set(in_rows))} are in the "
                                  "training rows, but embed_tokens and lm_head are not trained (an adapter): they "
                                  "would train as NaNs; add them to lora_modules_to_save, or train without an adapter")
            return
        counts = torch.zeros(max(len(tokenizer), inputs.shape[0]), dtype=torch.int64)
        for ids in _every_row(train_rows):
            counts += torch.bincount(torch.as_tensor(ids, dtype=torch.int64), minlength=counts.shape[0])[:counts.shape[0]]
        used = [t for t in candidates if counts[t] > 0]
        if not used:
            say("fix_untrained_tokens: the untrained tokens found are not in the training rows; no row changed")
            return
        scale = (counts[used].double() / max(int(counts.max()), 1)).unsqueeze(1)
        trained = inputs.shape[0] - len(found)
        for matrix in (inputs, outputs):
            mean = (matrix[:, :width].sum(0, dtype=torch.float32) - matrix[candidates, :width].sum(0, dtype=torch.float32)) / trained
            matrix[used, :width] = (mean.double().unsqueeze(0) * scale).to(matrix.dtype)
    say(f"fix_untrained_tokens: set the embedding and lm_head rows of {len(used)} untrained token(s) the data uses "
        f"({', '.join(map(str, used[:10]))}{', ...' if len(used) > 10 else ''}) to the mean of the trained rows, "
        "scaled by their frequency (as Axolotl)")
