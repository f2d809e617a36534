"""Preference dataset types (Axolotl's names): one row -> prompt text + completion text(s), then tokens.

Pair types (rl: dpo, ipo, orpo, simpo) give (prompt, chosen, rejected); KTO types give (prompt, completion,
label). The prompt and each completion are tokenised as ONE text (so the tokens at the seam are the ones
the model sees at inference), and a token is a completion token iff it starts inside the completion: the
prompt's tokens are labelled -100.

- chat_template.default:  {messages, chosen, rejected} (field_messages / field_chosen / field_rejected);
                          chosen/rejected are a message, a list whose last message is the answer, or a string.
- chat_template.argilla (and .argilla_chat): {chosen: [...conversation], rejected: [...]}, optional system
                          and prompt; the answer is the last message, the prompt the turns before it.
- chatml.* / llama3.*:    the template's text is written here, as Axolotl's dpo/ and kto/ strategies do:
    default       prompt|input|question|instruction, chosen|chosen_response, rejected|rejected_response
    argilla       instruction, chosen_response, rejected_response  (KTO: instruction, completion)
    argilla_chat  chosen[0] is the user turn, chosen[1]/rejected[1] the answers (KTO: completion[0]/[1])
    icr           input, chosen, rejected
    intel         question, chosen, rejected                      (KTO: question, completion)
    prompt_pairs  prompt, chosen, rejected                        (KTO: prompt, completion)
    ultra         prompt, chosen[1], rejected[1] (conversations)  (KTO: prompt, completion)
  each with an optional system field.
"""

from __future__ import annotations

from trainer.batch.labels import IGNORE
from trainer.config import DatasetConfig
from trainer.data.formats.roles import role_alias
from trainer.errors import DataError
from trainer.runtime.templates import render as budgeted  # the chat template under a time budget

WRAPPERS = {  # family -> (system turn, user turn + assistant header, end of the assistant turn)
    "chatml": ("<|im_start|>system\n{}<|im_end|>\n", "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
               "<|im_end|>"),
    "llama3": ("<|start_header_id|>system<|end_header_id|>\n\n{}<|eot_id|>",
               "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
               "<|eot_id|>"),
}


def _what(ds: DatasetConfig) -> str:
    return "a format of your own" if ds.preference_format else f"type {ds.type}"


def _get(row: dict, key: str, ds: DatasetConfig):
    if key not in row or row[key] is None:
        raise DataError(f"dataset {ds.source}: a row has no '{key}' field ({_what(ds)}); columns are {sorted(row)}")
    return row[key]


def _own(row: dict, ds: DatasetConfig, kto: bool) -> tuple[str, list[str]]:
    """A preference format of your own, as Axolotl's user_defined.default transforms (prompt_strategies/dpo and /kto):
    prompt_format over the prompt (and the row's system text, empty when the row has none), each completion through
    its own format; the results are used as they are (as rows without a type)."""
    fmt = ds.preference_format
    prompt_format = fmt.prompt_format or "{prompt}"
    prompt = prompt_format.format(prompt=_get(row, fmt.field_prompt, ds), system=row.get(fmt.field_system) or "")
    if kto:
        return prompt, [(fmt.completion_format or "{completion}").format(completion=_get(row, fmt.field_completion, ds))]
    return prompt, [(fmt.chosen_format or "{chosen}").format(chosen=_get(row, fmt.field_chosen, ds)),
                    (fmt.rejected_format or "{rejected}").format(rejected=_get(row, fmt.field_rejected, ds))]


def _first_key(row: dict, keys: tuple[str, ...], ds: DatasetConfig) -> str:
    for key in keys:
        if key in row:
            return key
    raise DataError(f"dataset {ds.path}: a row has none of the fields {list(keys)} (type {ds.type}); columns are {sorted(row)}")


def _content(message, ds: DatasetConfig) -> str:
    if isinstance(message, str):
        return message
    if isinstance(message, dict) and ds.content_key in message:
        return message[ds.content_key]
    raise DataError(f"dataset {ds.path}: expected a message with '{ds.content_key}', got {str(message)[:80]}")


def _nth(row: dict, key: str, n: int, ds: DatasetConfig) -> str:
    conversation = _get(row, key, ds)
    if not isinstance(conversation, list) or len(conversation) <= n:
        raise DataError(f"dataset {ds.path}: '{key}' must be a conversation of at least {n + 1} messages (type {ds.type})")
    return _content(conversation[n], ds)


def _templated(row: dict, ds: DatasetConfig, kto: bool) -> tuple[str, list[str]]:
    family, _, fn = ds.type.partition(".")
    fn = fn or "default"
    system_turn, user_turn, end = WRAPPERS[family]
    if fn == "argilla_chat":
        source = "completion" if kto else "chosen"
        user = _nth(row, source, 0, ds)
        answers = [_nth(row, "completion", 1, ds)] if kto else [_nth(row, "chosen", 1, ds), _nth(row, "rejected", 1, ds)]
        return user_turn.format(user), [a + end for a in answers]
    if kto:
        user_key = {"argilla": "instruction", "intel": "question", "prompt_pairs": "prompt", "ultra": "prompt"}[fn]
        answers = [str(_get(row, "completion", ds))]
    else:
        user_key = {"default": None, "argilla": "instruction", "icr": "input", "intel": "question",
                    "prompt_pairs": "prompt", "ultra": "prompt"}[fn]
        if fn == "default":
            user_key = _first_key(row, ("prompt", "input", "question", "instruction"), ds)
            keys = (_first_key(row, ("chosen", "chosen_response"), ds), _first_key(row, ("rejected", "rejected_response"), ds))
        elif fn == "argilla":
            keys = ("chosen_response", "rejected_response")
        else:
            keys = ("chosen", "rejected")
        if fn == "ultra":
            answers = [_nth(row, keys[0], 1, ds), _nth(row, keys[1], 1, ds)]
        else:
            answers = [str(_get(row, k, ds)) for k in keys]
    system = row.get("system")
    prompt = (system_turn.format(system) if system else "") + user_turn.format(_get(row, user_key, ds))
    return prompt, [a + end for a in answers]


def _message(m, ds: DatasetConfig, default_role: str) -> dict:
    if isinstance(m, str):
        return {"role": default_role, "content": m}
    if not isinstance(m, dict) or ds.role_key not in m or ds.content_key not in m:
        raise DataError(f"dataset {ds.path}: a message has no '{ds.role_key}'/'{ds.content_key}' "
                        f"({str(m)[:80]}); set message_property_mappings")
    alias = role_alias(ds)
    return {"role": alias.get(m[ds.role_key], m[ds.role_key]), "content": m[ds.content_key]}


def _answer(value, ds: DatasetConfig) -> dict:
    if isinstance(value, list):
        if not value:
            raise DataError(f"dataset {ds.path}: an empty chosen/rejected conversation")
        value = value[-1]
    return _message(value, ds, "assistant")


def _chat(row: dict, ds: DatasetConfig, tokenizer) -> tuple[str, list[str]]:
    if not tokenizer.chat_template:
        raise DataError("the tokenizer has no chat template; set chat_template: chatml, or jinja with chat_template_jinja")
    fn = ds.type.partition(".")[2] or "default"
    if fn == "default":
        messages = _get(row, ds.field_messages, ds)
        messages = [_message(m, ds, "user") for m in ([messages] if isinstance(messages, str) else messages)]
    else:  # argilla / argilla_chat: the prompt is the chosen conversation without its last message
        chosen = _get(row, ds.field_chosen, ds)
        if not isinstance(chosen, list) or len(chosen) < 2:
            raise DataError(f"dataset {ds.path}: '{ds.field_chosen}' must be a conversation ending with the answer")
        messages = [_message(m, ds, "user") for m in chosen[:-1]]
        if row.get("prompt") and len(chosen) == 2:
            messages = [{"role": "user", "content": row["prompt"]}]
        if row.get("system"):
            messages = [{"role": "system", "content": row["system"]}] + messages
    answers = [_answer(_get(row, ds.field_chosen, ds), ds), _answer(_get(row, ds.field_rejected, ds), ds)]

    def render(msgs, header: bool) -> str:
        return budgeted(tokenizer, msgs, tokenize=False, add_generation_prompt=header)

    prompt = render(messages, True)
    completions = []
    for answer in answers:
        full = render(messages + [answer], False)
        if not full.startswith(prompt):  # the generation header differs from the turn header
            prompt = render(messages, False)
        if not full.startswith(prompt):
            raise DataError(f"dataset {ds.path}: the chat template does not render the prompt as a prefix of the "
                            "conversation, so the answer cannot be located")
        completions.append(full[len(prompt):].rstrip())  # as Axolotl: up to the end-of-turn token
    return prompt, completions


def render(row: dict, ds: DatasetConfig, tokenizer, kto: bool) -> tuple[str, list[str], bool]:
    """(prompt, completions, add_special_tokens): chat templates render their own BOS; written templates do not.
    No type: the row's own prompt / chosen / rejected texts (field_prompt, field_chosen, field_rejected), used as
    they are, as Axolotl's DPO loader does with a dataset it has no transform for."""
    if ds.preference_format:
        prompt, completions = _own(row, ds, kto)
        return prompt, completions, True
    if ds.type is None:
        return (str(_get(row, ds.field_prompt, ds)),
                [str(_get(row, ds.field_chosen, ds)), str(_get(row, ds.field_rejected, ds))], True)
    if ds.type.startswith("chat_template"):
        prompt, completions = _chat(row, ds, tokenizer)
        return prompt, completions, False
    prompt, completions = _templated(row, ds, kto)
    return prompt, completions, True


def tokenize(prompt: str, completion: str, tokenizer, add_special: bool) -> dict:
    """input_ids of prompt + completion; labels -100 on the prompt's tokens. prompt_len: tokens before the first
    completion token (KTO's mismatched pairs splice prompts and completions at that point)."""
    text = prompt + completion
    enc = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = [t if end > start and start >= len(prompt) else IGNORE for t, (start, end) in zip(ids, enc["offset_mapping"])]
    if add_special and tokenizer.bos_token_id is not None and ids[:2] == [tokenizer.bos_token_id] * 2:
        ids, labels = ids[1:], labels[1:]  # the text already starts with BOS (Axolotl's remove_double_bos)
    first = next((i for i, l in enumerate(labels) if l != IGNORE), len(ids))
    return {"input_ids": ids, "labels": labels, "prompt_len": first}


def label_of(row: dict, ds: DatasetConfig) -> bool:
    value = _get(row, ds.preference_format.field_label if ds.preference_format else "label", ds)
    if not isinstance(value, bool):
        raise DataError(f"dataset {ds.path}: KTO's 'label' must be true (desirable) or false, got {value!r}")
    return value
