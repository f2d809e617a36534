"""Vision-language SFT (`processor_type`): SFT's loss over conversations with images, one conversation a row.

Data (prepare_data): each row of Axolotl's multimodal chat format (trainer/data/formats/vision.py) is checked (every
image opened: a missing file, unreadable data or a URL is one line naming the row) and measured through the
processor, and stored as JSON with its length and trained-token count; rows longer than sequence_len are dropped
(an image's tokens cannot be cut). Batches (collate): the processor renders and encodes the batch's conversations
with their images (pixel values and whatever else the model takes), padded, never packed (as Axolotl's
MultiModalChatDataCollator). The loss: cross-entropy summed over the trained tokens over the full logits, divided by
the step's trained tokens, as SFT's.
"""

from __future__ import annotations

import json

import torch

from trainer.batch.collate import count_targets
from trainer.data.formats import vision
from trainer.data.prepare import filter_and_split, held_out, load_raw, load_tokenizer, merged, prepare
from trainer.objectives import chunked_loss
from trainer.objectives.base import Objective
from trainer.objectives.sft import SFT

NOT_INPUTS = ("labels", "num_tokens")


class VisionSFT(SFT):
    name = "sft"

    @classmethod
    def from_config(cls, cfg, collator, token_loss_sum):
        tokenizer = load_tokenizer(cfg)  # the run's tokenizer, as the data was prepared with
        return cls(collator, token_loss_sum, setup=_setup(cfg, tokenizer))

    def __init__(self, collator, token_loss_sum, eval_loss_sum=None, setup=None):
        super().__init__(collator, token_loss_sum, eval_loss_sum)
        self.processor, self.tokenizer, self.masking, self.size, self.algorithm = setup

    @classmethod
    def prepare_data(cls, cfg, tokenizer, rank: int = 0, log=print):
        processor, tokenizer, m, size, _ = _setup(cfg, tokenizer)
        if rank == 0:
            log(note(cfg, m))

        def build(cfg, tokenizer):
            # heavy: datasets loads only when this runs
            import datasets

            def each(entries):
                parts = []
                for ds in entries:
                    raw = load_raw(ds, cfg.seed)
                    parts.append(datasets.Dataset.from_list(
                        [vision.prepared_row(row, i, ds, cfg, processor, tokenizer, m, size)
                         for i, row in enumerate(raw)]))
                return parts

            # rows are never truncated (an image's tokens cannot be cut): longer ones are dropped, or refused (raise)
            whole = cfg if cfg.excess_length_strategy == "raise" else cfg.model_copy(
                update={"excess_length_strategy": "drop"})
            data, validation, stats = filter_and_split(whole, merged(cfg, each(cfg.datasets)))
            if cfg.test_datasets:
                validation = held_out(whole, each(cfg.test_datasets))
            stats.update(train_rows=len(data), train_tokens=int(sum(data["length"])),
                         validation_rows=len(validation) if validation is not None else 0)
            return data, validation, stats

        return prepare(cfg, tokenizer, rank, log, builder=build, kind=vision.identity(processor, m, size))

    @classmethod
    def capacity(cls, cfg, packing: bool):
        return None  # one conversation a row: images are never packed

    @classmethod
    def describe(cls, cfg) -> str | None:
        return (f"vision-language SFT: {cfg.processor_type} from {cfg.base_model_config or cfg.base_model}; "
                "images from the conversations' image parts, one conversation a row (no packing)"
                + ("; vision tower and projector frozen (freeze_mm_modules)" if cfg.freeze_mm_modules else ""))

    def rows(self, dataset, reference=None):
        return ConversationRows(dataset)

    def collate(self, rows):
        examples = [example for row in rows for example in row]
        batch = vision.encode([json.loads(e["messages"]) for e in examples], self.processor, self.tokenizer,
                              self.masking, self.size, self.algorithm)
        batch["num_tokens"] = batch["attention_mask"].sum() if "attention_mask" in batch else \
            torch.tensor(batch["input_ids"].numel())
        return batch

    def step_stats(self, model, batch):
        return [count_targets(batch)]

    def loss(self, model, batch, totals):
        inputs = {k: v for k, v in batch.items() if k not in NOT_INPUTS}
        loss_sum = chunked_loss.full_loss_sum(model, inputs, batch["labels"])
        loss = loss_sum / max(totals["target_tokens"], 1)
        return loss, torch.stack([loss_sum.detach().double().cpu(),
                                  torch.tensor(float(batch["num_tokens"]), dtype=torch.float64)])

    def score(self, model, dataset, where, reference=None) -> dict:
        return Objective.score(self, model, dataset, where, reference)  # the split as one step (base.py)


class ConversationRows(torch.utils.data.Dataset):
    """The prepared conversations, indexed by rows (lists of one example index: never packed)."""

    def __init__(self, dataset):
        self.dataset = dataset.select_columns(["messages"])

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, row: list[int]) -> list[dict]:
        return [self.dataset[i] for i in row]


def _setup(cfg, tokenizer):
    processor = vision.load_processor(cfg, tokenizer)
    m = vision.masking(cfg, tokenizer, processor)
    size = cfg.image_size or vision.processor_image_size(processor)
    return processor, tokenizer, m, size, cfg.image_resize_algorithm


def note(cfg, m: vision.Masking) -> str:
    """The run's one line on which tokens are trained."""
    if cfg.train_on_inputs:
        return "vision-language: training on every token but padding and image tokens (train_on_inputs)"
    if not m.boundaries:
        return (f"vision-language: chat_template {cfg.chat_template} has no role boundaries here (matrices/vision.toml), "
                "so every token but padding and image tokens is trained, as Axolotl's base strategy does; set "
                "role_boundaries to train only the assistant's turns")
    return (f"vision-language: training the turns of {', '.join(sorted(m.roles))} (role boundaries of {m.source}; "
            f"train_on_eos {m.train_on_eos})")
