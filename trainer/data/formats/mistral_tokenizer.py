"""tokenizer_use_mistral_common: Mistral's own tokenizer (the mistral-common package), as Axolotl uses it.

The tokenizer is transformers' MistralCommonBackend over the model's tekken.json / tokenizer.model.vN, in
mistral-common's finetuning mode (Axolotl's choice). mistral-common has no text template: it encodes a
conversation straight to token ids, message by message, with control tokens between them ([INST], [/INST],
[SYSTEM_PROMPT], [THINK], </s>), so chat_template datasets are tokenized here instead of by trainer.data.formats.prompts:

- the ids are mistral-common's encoding of the whole conversation (ChatCompletionRequest.from_openai, so message
  content may be a string or a list of chunks, `{"type": "thinking", "thinking": ...}` included, and an assistant
  message may carry `reasoning_content`, Axolotl's default field_thinking);
- a turn of roles_to_train is located in those ids by encoding the conversation twice more with that turn's
  content replaced by a one-token placeholder ("A", then "B"): the ids that change are the turn's content. This
  compares whole conversations, not growing prefixes, because tokenizers up to v3 put the system prompt into the
  LAST user turn, so a prefix of a conversation is not encoded as a prefix of its ids;
- train_on_eos picks which </s> that closes an assistant turn is trained: turn (each trained turn's, the default,
  as Axolotl's), all (every assistant turn's), last (the last trained turn's), none. eot_tokens does not apply:
  mistral-common ends an assistant turn with </s>, which Axolotl's Mistral strategy uses as its end-of-turn too.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from trainer.batch.labels import IGNORE
from trainer.data.formats.roles import role_alias
from trainer.errors import ConfigError, DataError

PLACEHOLDERS = ("A", "B")  # one token each, and different: one of them differs from any turn's first/last token


def is_mistral(tokenizer) -> bool:
    return getattr(tokenizer, "backend", None) == "mistral_common"


def load(cfg):
    """MistralCommonBackend from tokenizer_config or base_model (a local directory holding tekken.json or
    tokenizer.model.vN, or a hub id), in finetuning mode."""
    if importlib.util.find_spec("mistral_common") is None:
        raise ConfigError("tokenizer_use_mistral_common: the mistral-common package is not installed in this "
                          "environment (pip install 'envtool-llm[mistral]', or mistral-common)")
    # heavy: transformers loads only when this runs
    from transformers.tokenization_mistral_common import MistralCommonBackend

    source = cfg.tokenizer_config or cfg.base_model
    kwargs = {"revision": cfg.revision_of_model} if cfg.revision_of_model else {}
    try:
        if Path(source).expanduser().is_file():  # the tokenizer file itself, as Axolotl's loader also takes
            return MistralCommonBackend(tokenizer_path=Path(source).expanduser(), mode="finetuning")
        return MistralCommonBackend.from_pretrained(source, mode="finetuning", **kwargs)
    except Exception as err:  # hub, file and format errors come in many types; the first line says which
        raise ConfigError(f"cannot load the mistral-common tokenizer from {source}: "
                          f"{(str(err).splitlines() or [type(err).__name__])[0]}") from None


def identity(tokenizer) -> str:
    """The tokenizer file and the mode: what decides the ids (for the dataset cache key)."""
    h = hashlib.sha256(tokenizer.tokenizer.instruct_tokenizer.tokenizer.file_path.read_bytes())
    h.update(f"{type(tokenizer).__name__} {tokenizer.mode.value}".encode())
    return h.hexdigest()


def _messages(row: dict, ds) -> list[dict]:
    """The row's messages in OpenAI form: role (mapped by `roles`, else human/gpt as Axolotl does), content (string or chunks) and, where the row
    has it, reasoning_content (message_property_mappings may name its field, as Axolotl's field_thinking)."""
    alias = role_alias(ds)
    thinking_key = (ds.message_property_mappings or {}).get("reasoning_content", "reasoning_content")
    messages = []
    rows = row.get(ds.field_messages)
    if not isinstance(rows, list):
        raise DataError(f"dataset {ds.path}: a row has no '{ds.field_messages}' list (type chat_template); "
                        f"columns are {sorted(row)}; set field_messages")
    for m in rows:
        if ds.role_key not in m or ds.content_key not in m:
            raise DataError(f"dataset {ds.path}: a message has no '{ds.role_key}'/'{ds.content_key}' "
                            f"(keys: {sorted(m)}); set message_property_mappings")
        message = {"role": alias.get(m[ds.role_key], m[ds.role_key]), "content": m[ds.content_key]}
        if isinstance(message["content"], list):  # chunks: drop keys a table format fills with null
            message["content"] = [{k: v for k, v in chunk.items() if v is not None} for chunk in message["content"]]
        if m.get(thinking_key) is not None:
            message["reasoning_content"] = m[thinking_key]
        messages.append(message)
    if ds.drop_system_message:
        messages = [m for m in messages if m["role"] != "system"]
    return messages


def encode(tokenizer, messages: list[dict], ds) -> list[int]:
    """mistral-common's ids for a conversation (finetuning mode: it must end with an assistant turn)."""
    # optional: mistral_common is imported only where it is used
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    try:
        request = ChatCompletionRequest.from_openai(messages)
        return list(tokenizer.tokenizer.encode_chat_completion(request).tokens)
    except Exception as err:  # mistral-common's validation errors: the message says what is wrong with the row
        raise DataError(f"dataset {ds.path}: mistral-common cannot encode a conversation "
                        f"(roles {[m.get('role') for m in messages]}): "
                        f"{(str(err).splitlines() or [type(err).__name__])[0]}") from None


def turn_span(tokenizer, messages: list[dict], index: int, ids: list[int], ds) -> tuple[int, int]:
    """[start, end) of message `index`'s content in `ids`, the encoding of `messages`."""
    start, end = len(ids), 0
    for placeholder in PLACEHOLDERS:
        changed = [dict(m) for m in messages]
        changed[index] = {"role": messages[index]["role"], "content": placeholder}
        other = encode(tokenizer, changed, ds)
        if other == ids:  # the turn's content is this placeholder: the other one tells
            continue
        prefix = 0
        while prefix < min(len(ids), len(other)) and ids[prefix] == other[prefix]:
            prefix += 1
        suffix = 0
        while suffix < min(len(ids), len(other)) - prefix and ids[-1 - suffix] == other[-1 - suffix]:
            suffix += 1
        start, end = min(start, prefix), max(end, len(ids) - suffix)
    return start, max(start, end)


def tokenize_chat(row: dict, ds, tokenizer, train_on_inputs: bool) -> dict:
    messages = _messages(row, ds)
    ids = encode(tokenizer, messages, ds)
    if train_on_inputs:
        return {"input_ids": ids, "labels": list(ids)}
    labels = [IGNORE] * len(ids)
    policy = ds.train_on_eos or "turn"
    eos = tokenizer.eos_token_id
    trained_eos = []  # (position, turn trained?) of the </s> closing each assistant turn located
    for i, message in enumerate(messages):
        trained = message["role"] in ds.roles_to_train
        if not trained and not (policy == "all" and message["role"] == "assistant"):
            continue
        start, end = turn_span(tokenizer, messages, i, ids, ds)
        if trained:
            labels[start:end] = ids[start:end]
        if message["role"] == "assistant" and end < len(ids) and ids[end] == eos:
            trained_eos.append((end, trained))
    if policy in ("turn", "all"):
        picked = [pos for pos, trained in trained_eos if trained or policy == "all"]
    elif policy == "last":
        picked = [pos for pos, trained in trained_eos if trained][-1:]
    else:
        picked = []
    for pos in picked:
        labels[pos] = ids[pos]
    return {"input_ids": ids, "labels": labels}
