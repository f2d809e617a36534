"""Prompt formats: one row of a dataset -> token ids and labels.

Each format renders the row as text plus the character spans to train on; one tokenizer call with
offsets then labels exactly the tokens that start inside those spans. Everything else is -100
unless train_on_inputs.

- alpaca:       {instruction, input?, output}; trains on the output and EOS. alpaca:<style> (instruct, chat,
                chatml, phi) writes the prompt in Axolotl's style of that name (trainer.data.formats.alpaca_styles).
- completion:   {text}; trains on all of it and EOS.
- input_output: {segments: [{text, label}]}; trains on segments with label: true. No special tokens added.
- a format of your own (type: a mapping) and Axolotl's older instruction types (alpaca_chat[.load_*],
                context_qa[.load_*], oasst[:style]): trainer.data.formats.instruction.
- chat_template:{messages: [{role, content}]} rendered by the chat template (the tokenizer's, or one named
                in chat_template, see trainer.data.formats.chat_templates); trains on the turns of roles_to_train
                (default: assistant), without the turn header, with its reasoning text (field_thinking ->
                template_thinking_key) where the template renders one; train_on_eos / eot_tokens pick the
                end-of-turn tokens trained (turn: each trained turn's, all: every turn's, last: the
                conversation's last, none: no EOT).
"""

from __future__ import annotations

import json
import os

from trainer.batch.labels import IGNORE
from trainer.config import DatasetConfig
from trainer.config.datasets import eot_conflict
from trainer.data.formats import alpaca_styles, instruction
from trainer.data.formats.roles import role_alias
from trainer.errors import DataError
from trainer.runtime.templates import render as budgeted  # the chat template under a time budget

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

Spans = list[tuple[int, int]]


def _field(row: dict, key: str, ds: DatasetConfig, required: bool = True):
    if key not in row or (required and row[key] is None):
        if required:
            raise DataError(f"dataset {ds.path}: a row has no '{key}' field (type {ds.type}); "
                            f"columns are {sorted(row)}; map the field in the dataset's config")
        return None
    return row[key]


def render_alpaca(row: dict, ds: DatasetConfig, tokenizer) -> tuple[str, Spans, bool]:
    instruction = _field(row, ds.field_instruction, ds)
    extra = _field(row, ds.field_input, ds, required=False)
    output = _field(row, ds.field_output, ds)
    prompt = alpaca_styles.prompt(alpaca_styles.style_of(ds.type), instruction, extra)  # alpaca[:style]
    text = prompt + str(output) + (tokenizer.eos_token or "")
    return text, [(len(prompt), len(text))], True


def render_completion(row: dict, ds: DatasetConfig, tokenizer) -> tuple[str, Spans, bool]:
    text = str(_field(row, ds.field, ds)) + (tokenizer.eos_token or "")
    return text, [(0, len(text))], True


def render_input_output(row: dict, ds: DatasetConfig, tokenizer) -> tuple[str, Spans, bool]:
    text, spans = "", []
    for seg in _field(row, ds.field_segments, ds):
        start = len(text)
        text += seg["text"]
        if seg.get("label", True):
            spans.append((start, len(text)))
    return text, spans, False


def _messages(row: dict, ds: DatasetConfig) -> list[dict]:
    alias = role_alias(ds)
    messages = []
    for m in _field(row, ds.field_messages, ds):
        if ds.role_key not in m or ds.content_key not in m:
            raise DataError(f"dataset {ds.path}: a message has no '{ds.role_key}'/'{ds.content_key}' "
                            f"(keys: {sorted(m)}); set message_property_mappings")
        message = {"role": alias.get(m[ds.role_key], m[ds.role_key]), "content": m[ds.content_key]}
        # Axolotl's mapping: message_property_mappings' other keys, or (when it is not given) the reasoning
        # text from field_thinking into the template's template_thinking_key; it renders, and trains, with its turn
        extra = {k: v for k, v in (ds.message_property_mappings or {}).items() if k not in ("role", "content")}
        if not ds.message_property_mappings:
            extra[ds.template_thinking_key] = ds.field_thinking
        message.update({key: m[field] for key, field in extra.items() if m.get(field) is not None})
        if ds.split_thinking and message["role"] == "assistant" and isinstance(message["content"], str):
            message.update(split_thinking(message["content"], ds.template_thinking_key))
        if ds.message_field_training and m.get(ds.message_field_training) is not None:
            message[TRAIN_FLAG] = m[ds.message_field_training]
        if ds.message_field_training_detail and m.get(ds.message_field_training_detail) is not None:
            message[TRAIN_DETAIL] = _detail(m[ds.message_field_training_detail], ds)
        messages.append(message)
    return messages


TRAIN_FLAG = "\0train"  # a message's own training flag (message_field_training), taken out before rendering
TRAIN_DETAIL = "\0detail"  # its character spans (message_field_training_detail), taken out before rendering


def _detail(detail, ds: DatasetConfig) -> list[tuple[int, int, bool]]:
    """A message's training detail as (begin, end inclusive, train) triples; one line naming what is wrong."""
    key = ds.message_field_training_detail
    if not isinstance(detail, list) or not all(
            isinstance(d, dict) and isinstance(d.get("begin_offset"), int) and isinstance(d.get("end_offset"), int)
            and isinstance(d.get("train", False), bool) for d in detail):
        raise DataError(f"dataset {ds.path}: a message's '{key}' must be a list of {{begin_offset, end_offset, train}} "
                        f"(integer offsets into its content, inclusive); got {str(detail)[:120]}")
    return [(d["begin_offset"], d["end_offset"], d.get("train", False)) for d in detail]


def content_parts(content) -> tuple[str, list[tuple[int, int, bool]] | None] | None:
    """A message's content given as a list of parts, as Axolotl's ChatTemplateStrategy._convert_content_parts reads
    it: the parts' texts (`text`, else `content`, else `value`) joined, and, where any part says `train` (or
    `weight`: 0 is no), a training detail with each part's characters (a part without either trains). None: not a
    list."""
    if not isinstance(content, list):
        return None
    texts, detail, explicit = [], [], False
    for part in content:
        if not isinstance(part, dict):
            continue
        text = part.get("text") or part.get("content") or part.get("value") or ""
        train, weight = part.get("train"), part.get("weight")
        explicit = explicit or train is not None or weight is not None
        trains = bool(train) if train is not None else weight not in (0, 0.0) if weight is not None else True
        if text:
            offset = sum(map(len, texts))
            detail.append((offset, offset + len(text) - 1, trains))
        texts.append(text)
    return "".join(texts), detail if explicit else None


def _join_parts(message: dict, ds: DatasetConfig) -> None:
    """Content (and reasoning) given as a list of text parts, joined as Axolotl joins them; the parts' own training
    flags become the message's training detail."""
    joined = content_parts(message["content"])
    if joined is not None:
        message["content"] = joined[0]
        if joined[1] is not None:
            message[TRAIN_DETAIL] = joined[1]
    joined = content_parts(message.get(ds.template_thinking_key))
    if joined is not None:
        if joined[1] is not None:
            raise DataError(f"dataset {ds.path}: training flags on the parts of a message's "
                            f"{ds.template_thinking_key} are not supported (its reasoning trains with its turn); flag "
                            "the content's parts, or the whole message")
        message[ds.template_thinking_key] = joined[0]


def detail_token_starts(content: str, detail: list[tuple[int, int, bool]], tokenizer) -> list[int]:
    """The character offsets (in `content`) of the tokens a training detail trains, as Axolotl's
    ChatTemplatePrompter.get_offsets_for_train_detail picks them: the content tokenized alone, each token's span
    running to the next token's start; each detail widened to the tokens it cuts (adjust_train_details); a token
    trains where a detail with train: true holds it whole."""
    starts = [a for a, _ in tokenizer(content, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]]
    if not starts:
        return []
    spans = [(a, b - 1) for a, b in zip(starts, starts[1:])] + [(starts[-1], len(content) - 1)]
    adjusted = []
    for begin, end, train in detail:
        first = next((i for i, (a, _) in enumerate(spans) if a >= begin), len(spans))
        if first > 0 and spans[first - 1][1] > begin:
            first -= 1
        last = next((i for i in range(len(spans) - 1, -1, -1) if spans[i][1] <= end), -1)
        if last < len(spans) - 1 and spans[last + 1][0] < end:
            last += 1
        if first <= last:
            adjusted.append((spans[first][0], spans[last][1], train))
    return [a for a, b in spans if any(train and a >= lo and b <= hi for lo, hi, train in adjusted)]
THINKING_PAIRS = (("<think>", "</think>"), ("<reasoning>", "</reasoning>"), ("<|begin_of_thought|>", "<|end_of_thought|>"))
SOLUTION_PAIR = ("<|begin_of_solution|>", "<|end_of_solution|>")


def split_thinking(content: str, key: str) -> dict:
    """split_thinking as Axolotl's ChatTemplateStrategy.transform_message does it: the first pair of thinking tags
    found gives the reasoning (stripped) under `key`; the content is what follows the closing tag (its leading
    whitespace dropped), or the solution block inside it (stripped). No pair: the content as it is."""
    for begin, end in THINKING_PAIRS:
        if begin in content and end in content:
            start, stop = content.find(begin), content.find(end)
            rest = content[stop + len(end):].lstrip()
            b, e = SOLUTION_PAIR
            if b in rest and e in rest:
                rest = rest[rest.find(b) + len(b):rest.find(e)].strip()
            return {key: content[start + len(begin):stop].strip(), "content": rest}
    return {}


def tools_of(row: dict, ds: DatasetConfig) -> list[dict] | None:
    """The row's tool definitions for the chat template (Axolotl's _get_tools): a list of dicts, or its JSON text; a
    function's parameters given as JSON text are read too. None where the row has none."""
    tools = row.get(ds.field_tools)
    try:
        if isinstance(tools, str):
            tools = json.loads(tools)
        for tool in tools if isinstance(tools, list) else []:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("parameters"), str):
                function["parameters"] = json.loads(function["parameters"])
    except json.JSONDecodeError as err:
        raise DataError(f"dataset {ds.path}: '{ds.field_tools}' is not valid JSON ({err})") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"dataset {ds.path}: '{ds.field_tools}' must be a list of tool definitions (dicts); got "
                        f"{type(tools).__name__}")
    return tools or None


def _template(ds: DatasetConfig, tokenizer) -> str:
    """The chat template a dataset renders with: its own, else the tokenizer's."""
    template = tokenizer.chat_template
    if ds.chat_template:  # this dataset's own template
        # start-up: trainer.data.formats.chat_templates imported only when this runs
        from trainer.data.formats.chat_templates import resolve

        template = resolve(ds.chat_template, ds.chat_template_jinja, tokenizer)
    if not template:
        raise DataError("the tokenizer has no chat template; set chat_template: chatml (or another name), or jinja "
                        "with chat_template_jinja")
    return template


def render_chat(row: dict, ds: DatasetConfig, tokenizer, eot_tokens: list[str] | None = None,
                template_kwargs: dict | None = None) -> tuple[str, Spans, bool]:
    template = _template(ds, tokenizer)
    messages = _messages(row, ds)
    if ds.drop_system_message:
        messages = [m for m in messages if m["role"] != "system"]
    for message in messages:
        _join_parts(message, ds)
    flags = [m.pop(TRAIN_FLAG, None) for m in messages]
    details = [m.pop(TRAIN_DETAIL, None) for m in messages]
    # Axolotl's prompter: the config's chat_template_kwargs, and the row's tools where it has some, on every render
    tools = tools_of(row, ds)
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}

    def render(msgs, header=False):
        if not msgs:
            return ""
        return budgeted(tokenizer, msgs, tokenize=False, add_generation_prompt=header, chat_template=template, **extra)

    text = render(messages)
    # train_on_eos (Axolotl's): which end-of-turn tokens are trained. Unset and no eot_tokens: the whole
    # rendered tail of each trained turn (its EOT and any separator after it) is trained.
    # train_on_eot (Axolotl's), where set, decides the end-of-turn tokens instead; an EOS among them follows both
    policy = ds.train_on_eot or ds.train_on_eos or ("turn" if eot_tokens else None)
    eots = [t for t in (eot_tokens or [tokenizer.eos_token]) if t]
    if ds.train_on_eot and tokenizer.eos_token in eots and ds.train_on_eot != (ds.train_on_eos or "turn"):
        raise DataError(eot_conflict(f"dataset {ds.path}", ds))
    spans = []
    last = len(messages) - 1
    for i, message in enumerate(messages):
        # a message's own flag, else its training detail (trained where it has one), else its role (Axolotl's order)
        trained = (bool(flags[i]) if flags[i] is not None else bool(details[i]) if details[i] is not None
                   else message["role"] in ds.roles_to_train)
        if not trained and policy != "all":
            continue
        region = _turn_region(messages, i, text, render, eots)
        if region is None:  # the template renders nothing of this turn
            continue
        turn_start, begin, end = region
        begin = begin if trained else turn_start
        if trained:
            # a turn trains from its first text (its reasoning where the template renders one, else its content), not
            # from the header or an empty reasoning block before it (Qwen3's '<think>\n\n</think>'): where Axolotl's
            # chat_template strategy starts it (tests/trainer/data/test_turn_flags.py compares the two)
            found_at = _text_at(text, message["content"], begin, end)
            think_at = _text_at(text, message.get(ds.template_thinking_key), begin, end)  # rendered before the content
            found_at = think_at if think_at >= 0 and (found_at < 0 or think_at < found_at) else found_at
            begin = found_at if found_at >= 0 else begin
        if trained and details[i]:  # only the tokens its detail trains, where its content is rendered
            content_at = _content_at(text, message, turn_start, end, ds)
            spans.extend((content_at + a, content_at + a + 1) for a in
                         detail_token_starts(message["content"], details[i], tokenizer))
            trained_span = None
        else:
            trained_span = (begin, end)
        if policy is None:
            if trained_span:
                spans.append(trained_span)
            continue
        # the turn's end-of-turn token follows its content: a reasoning block before the content (gpt-oss's
        # analysis channel) may end in the same token, and is trained as part of the turn
        body = message["content"].strip() if isinstance(message["content"], str) else ""
        after = text.rfind(body, begin, end) if body else -1
        after = after + len(body) if after >= 0 else begin
        found = [(text.find(t, after, end), t) for t in eots]
        found = [(pos, t) for pos, t in found if pos >= 0]
        eot_at, eot = min(found) if found else (end, "")
        if trained and trained_span:
            spans.append((begin, eot_at))
        if eot and (policy in ("turn", "all") and (trained or policy == "all") or (policy == "last" and i == last)):
            spans.append((eot_at, eot_at + len(eot)))
    return text, spans, False


SENTINELS = ("[[dummy_message]]", "zzdummymessagezz")  # Axolotl's two, with disjoint first and last characters


def _turn_region(messages: list[dict], i: int, text: str, render, eots: list[str]) -> tuple[int, int, int] | None:
    """Where turn i is in the conversation's render `text`: (its start, where its own text may start (after its
    header), its end); None where the template renders nothing of it.

    Rendered turn by turn (the conversation up to turn i renders as the start of the whole), the renders of the turns
    before it and of its header bound it. A template that renders a turn differently once later turns follow (Qwen3
    drops the reasoning of assistant turns before the last user turn) is located as Axolotl's ChatTemplateStrategy
    ._find_turn_from_text locates it: the whole conversation rendered again with the turn's content replaced by a
    placeholder, the characters that differ (the widest over two placeholders) being the turn's own text; it ends at
    the end-of-turn token after that text."""
    prefix, whole = render(messages[:i]), render(messages[: i + 1])
    start = render(messages[:i], header=True) if i else ""
    if not text.startswith(start):  # template's generation header differs from its turn header
        start = prefix
    if text.startswith(whole) and text.startswith(start):
        return len(prefix), len(start), len(whole)
    lo, hi = len(text), 0
    for sentinel in SENTINELS:
        other = render(messages[:i] + [{"role": messages[i]["role"], "content": sentinel}] + messages[i + 1:])
        same_start = len(os.path.commonprefix([text, other]))
        most = min(len(text), len(other)) - same_start
        same_end = len(os.path.commonprefix([text[::-1], other[::-1]]))
        lo, hi = min(lo, same_start), max(hi, len(text) - min(same_end, most))
    if hi <= lo:
        return None
    found = [text.find(t, hi) for t in eots]
    end = min((at + len(t) for at, t in zip(found, eots) if at >= 0), default=hi)
    return lo, lo, end


def _text_at(text: str, value, start: int, end: int) -> int:
    """Where a message's text is rendered after `start` (its header): as written (a leading space trains, as in
    Axolotl), else stripped (a template that trims it); -1 where it is not a non-blank string or not found."""
    if not isinstance(value, str) or not value.strip():
        return -1
    at = text.find(value, start, end)
    return at if at >= 0 else text.find(value.strip(), start, end)


def _content_at(text: str, message: dict, start: int, end: int, ds: DatasetConfig) -> int:
    """Where a message's content (a string: its training detail's offsets count its characters) is rendered."""
    content = message["content"]
    at = text.rfind(content, start, end) if isinstance(content, str) and content else -1  # after any reasoning
    if at < 0:
        raise DataError(f"dataset {ds.path}: {ds.message_field_training_detail}: a message's training detail needs its "
                        "content as a string that the chat template renders as it is")
    return at


RENDERERS = {
    "alpaca": render_alpaca,
    "completion": render_completion,
    "input_output": render_input_output,
    "chat_template": render_chat,
}


def tokenize_row(row: dict, ds: DatasetConfig, tokenizer, train_on_inputs: bool,
                 eot_tokens: list[str] | None = None, template_kwargs: dict | None = None) -> dict:
    # start-up: trainer.data.formats.mistral_tokenizer imported only when this runs
    from trainer.data.formats import mistral_tokenizer

    if ds.type == "chat_template" and mistral_tokenizer.is_mistral(tokenizer):  # ids, not text: see that module
        return mistral_tokenizer.tokenize_chat(row, ds, tokenizer, train_on_inputs)
    if ds.type == "chat_template":
        text, spans, add_special = render_chat(row, ds, tokenizer, eot_tokens, template_kwargs)
    elif ds.user_defined is not None or ds.type in instruction.NAMED:
        text, spans, add_special = instruction.render(row, ds, tokenizer)
    else:
        text, spans, add_special = RENDERERS[ds.type.partition(":")[0]](row, ds, tokenizer)
    enc = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if train_on_inputs:
        labels = list(ids)
    else:
        # a token is trained if it starts inside a trained span; added special tokens have empty offsets
        labels = [tok if end > start and any(s <= start < e for s, e in spans) else IGNORE
                  for tok, (start, end) in zip(ids, enc["offset_mapping"])]
    return {"input_ids": ids, "labels": labels}
