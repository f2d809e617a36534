"""Axolotl's instruction formats beyond `alpaca`: a row's fields -> (instruction, input, output), written by an
alpaca-style prompter (a system text, then the turn with or without the input), then the output and EOS.

Two families, both rendered by `render` below:

- Axolotl's older named types (its prompt_strategies/ alpaca_chat.py, context_qa.py and prompt_tokenizers.py's
  OpenAssistant strategy, v0.4.0-v0.5.x): each a row -> fields function and a prompter (a style of
  trainer.data.formats.alpaca_styles, or its own turn formats) with the system texts of its prompter class.
- alpaca_w_system (its prompt_strategies/alpaca_w_system.py): an alpaca style whose system text is the row's own
  (`system`, or OpenOrca's `system_prompt`), written only where it is not empty; load/load_chat the chat style,
  load_instruct the instruct style, load_open_orca(_chatml) OpenOrcaSystemDataPrompter's own turn formats over
  question/response.
- a user-defined format (`type:` given as a mapping; Axolotl's prompt_strategies/user_defined.py over
  alpaca_w_system.SystemDataPrompter): the mapping's turn formats; the system text is the row's field_system column,
  else system_prompt, written with system_format, and only where it is not empty.

As in Axolotl, the system text is written only where it is not empty, and the output follows the prompt directly;
only the output and EOS are trained (unless train_on_inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from trainer.config import DatasetConfig
from trainer.data.formats import alpaca_styles
from trainer.errors import DataError


@dataclass(frozen=True)
class Prompter:
    system_format: str
    turn_format: str
    turn_no_input_format: str
    system_with_input: str = alpaca_styles.SYSTEM_WITH_INPUT
    system_no_input: str = alpaca_styles.SYSTEM_NO_INPUT

    def prompt(self, instruction: str, input_text: str, system: str | None = None) -> str:
        """AlpacaPrompter._build_result (system None) and SystemDataPrompter.build_prompt_w_system (system given)."""
        if system is None:
            system = self.system_with_input if input_text else self.system_no_input
        head = self.system_format.format(system=system) if system and self.system_format else ""
        if input_text:
            return head + self.turn_format.format(instruction=instruction, input=input_text)
        return head + self.turn_no_input_format.format(instruction=instruction)


def _style(name: str, **systems: str) -> Prompter:
    return Prompter(*alpaca_styles.STYLES[name], **systems)


# alpaca_chat.AlpacaChatPrompter / AlpacaConcisePrompter: chat style, these system texts
_CHAT_SYSTEMS = dict(
    system_with_input="Below is an instruction from a USER that describes a task, paired with an input that provides "
                      "further context. The ASSISTANT writes a response that concisely and appropriately completes the "
                      "request.\n\n",
    system_no_input="Below is an instruction from a USER that describes a task. The ASSISTANT writes a response that "
                    "appropriately and concisely completes the request.\n\n")
# context_qa.AlpacaContextPrompter: chat style, one system text
_CONTEXT = "Use the following contextual information to concisely answer the question.\n"
_NOT_IN_CONTEXT = ("The context provided does not contain any information about your inquiry. "
                   "Therefore, I'm unable to answer your question based on the given context.")

Fields = Callable[[dict], tuple]  # row -> (instruction, input, output[, the row's system text])

# alpaca_w_system.OpenOrcaSystemDataPrompter.match_prompt_style: (system_format, turn_format, turn_no_input_format)
_OPEN_ORCA = ("### System:\n{system}\n", "### Human:\n{instruction}\n### Additional Context:\n{input}\n### Assistant:\n",
              "### Human:\n{instruction}\n### Assistant:\n")
_OPEN_ORCA_CHATML = ("<|im_start|>system\n{system}<|im_end|>\n",
                     "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
                     "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n")


def _alpaca(row: dict) -> tuple:
    return row["instruction"], row.get("input") or "", row["output"]


# type -> (prompter, fields)
NAMED: dict[str, tuple[Prompter, Fields]] = {
    "alpaca_chat": (_style("chat"), _alpaca),
    "alpaca_chat.load_qa": (_style("chat", **_CHAT_SYSTEMS), lambda r: (r["question"], "", r["answer"])),
    "alpaca_chat.load_concise": (_style("chat", **_CHAT_SYSTEMS), _alpaca),
    "alpaca_chat.load_camel_ai": (_style("chat", **_CHAT_SYSTEMS), lambda r: (r["message_1"], "", r["message_2"])),
    "context_qa": (_style("chat", system_with_input=_CONTEXT, system_no_input=_CONTEXT),
                   lambda r: (r["article"] + "\n===\n" + r["question"], "", r["answer"])),
    "context_qa.load_404": (_style("chat", system_with_input=_CONTEXT, system_no_input=_CONTEXT),
                            lambda r: (r["article"] + "\n===\n" + r["unanswerable_question"], "", _NOT_IN_CONTEXT)),
    "context_qa.load_v2": (Prompter("{system}", "{instruction}\n{input}", "{instruction}", "", ""),
                           lambda r: ("Context: " + r["context"] + "\nQuestion: " + r["question"] + "\n", "",
                                      "Answer: " + r["answer"])),
    **{name: (_style(name.partition(":")[2] or "instruct"), lambda r: (r["INSTRUCTION"], "", r["RESPONSE"]))
       for name in ("oasst", "oasst:instruct", "oasst:chat", "oasst:chatml", "oasst:phi")},
    # InstructionWSystemPromptTokenizingStrategy: instruction, input (may be absent), output, system (required)
    **{name: (_style(style), lambda r: (r["instruction"], r.get("input") or "", r["output"], r["system"]))
       for name, style in (("alpaca_w_system", "chat"), ("alpaca_w_system.load_chat", "chat"),
                           ("alpaca_w_system.load_instruct", "instruct"))},
    **{name: (Prompter(*formats), lambda r: (r["question"], "", r["response"], r["system_prompt"]))
       for name, formats in (("alpaca_w_system.load_open_orca", _OPEN_ORCA),
                             ("alpaca_w_system.load_open_orca_chatml", _OPEN_ORCA_CHATML))},
}


def render(row: dict, ds: DatasetConfig, tokenizer) -> tuple[str, list[tuple[int, int]], bool]:
    """The row as text, and the span trained (the output and EOS)."""
    fmt = ds.user_defined
    try:
        if fmt is not None:
            instruction = row[fmt.field_instruction]
            input_text = row.get(fmt.field_input) or ""
            output = row.get(fmt.field_output) or ""
            system = row[fmt.field_system] if fmt.field_system in row else fmt.system_prompt
            prompt = Prompter(fmt.system_format, fmt.format, fmt.no_input_format).prompt(
                str(instruction), str(input_text), str(system or ""))
        else:
            prompter, fields = NAMED[ds.type]
            instruction, input_text, output, *system = fields(row)
            prompt = prompter.prompt(str(instruction), str(input_text or ""), str(system[0] or "") if system else None)
    except KeyError as err:
        what = "a format of your own" if fmt is not None else f"type {ds.type}"
        raise DataError(f"dataset {ds.source}: a row has no {err.args[0]!r} field ({what}); columns are "
                        f"{sorted(row)}") from None
    text = prompt + str(output) + (tokenizer.eos_token or "")
    return text, [(len(prompt), len(text))], True
