"""Axolotl's alpaca prompt styles: dataset `type: alpaca:<style>` (axolotl.prompters.AlpacaPrompter).

`alpaca` is `alpaca:instruct`. Each style is a system format and two turn formats (with and without an
input); the system line is Axolotl's fixed alpaca system prompt. The text is Axolotl's, character for
character, quirks included (phi's turn with an input puts the input after `<|end|>`, with no newlines).
The output follows the prompt, then EOS; only the output and EOS are trained (unless train_on_inputs).
"""

from __future__ import annotations

from trainer.config.datasets import ALPACA_TYPES

SYSTEM_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.")
SYSTEM_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes the request."

# style: (system format, turn format with input, turn format without input)
STYLES: dict[str, tuple[str, str, str]] = {
    "instruct": ("{system}\n\n",
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
                 "### Instruction:\n{instruction}\n\n### Response:\n"),
    "chat": ("SYSTEM: {system}\n",
             "USER: {instruction}\n{input}\nASSISTANT:",
             "USER: {instruction}\nASSISTANT:"),
    "chatml": ("<|im_start|>system\n{system}<|im_end|>\n",
               "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n"),
    "phi": ("<|system|>\n{system}<|end|>\n",
            "<|user|>\n{instruction}<|end|>{input}<|assistant|>",
            "<|user|>\n{instruction}<|end|>\n<|assistant|>\n"),
}
TYPES = ALPACA_TYPES  # (the names, which the config checks a dataset's type against)
assert TYPES == ("alpaca", *(f"alpaca:{style}" for style in STYLES)), "trainer/config/datasets.py ALPACA_TYPES"


def style_of(dataset_type: str) -> str:
    return dataset_type.partition(":")[2] or "instruct"


def prompt(style: str, instruction: str, input_text: str | None) -> str:
    system, turn, turn_no_input = STYLES[style]
    if input_text:
        return system.format(system=SYSTEM_WITH_INPUT) + turn.format(instruction=instruction, input=input_text)
    return system.format(system=SYSTEM_NO_INPUT) + turn_no_input.format(instruction=instruction)
