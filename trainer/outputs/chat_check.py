"""A model that stops where it should: the chat template's end-of-turn token in generation_config.json, and a check.

Chat models are trained to end an assistant turn with the template's end-of-turn token (ChatML's <|im_end|>,
Llama 3's <|eot_id|>, Gemma's <end_of_turn>), which is often not the tokenizer's eos_token. transformers' generate()
(and vLLM, and llama.cpp through the GGUF's eos/eot ids) stops on generation_config.json's eos_token_id; when that
lists only the tokenizer's eos, the model writes its end-of-turn token and keeps going (LLaMA-Factory #7454, #2884;
unsloth #384, #416; vllm #7327). So:

- ``end_of_turn(tokenizer)`` finds the token the saved template writes after an assistant message: it renders a
  conversation whose last assistant turn is a marker string, and takes the first special token after the marker
  (mistral-common tokenizers have no text template; their assistant turns end with </s>, the eos);
- ``write_generation_config(model_dir, tokenizer, ...)`` writes generation_config.json whose eos_token_id lists the
  eos, that end-of-turn token and the config's eot_tokens (the base model's own generation settings are kept);
- ``chat_check(...)`` renders one conversation with the saved template, generates greedily on CPU with the saved
  generation config, as a user's inference would, and says whether the reply ends with an end-of-turn token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.errors import ConfigError
from trainer.runtime.templates import render  # the chat template under a time budget, as data preparation renders it

MARKER = "Zq7Marker"  # an assistant message no template rewrites; the text after it is the turn's tail
CONVERSATION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_NEW_TOKENS = 32


def is_mistral_common(tokenizer) -> bool:
    return getattr(tokenizer, "backend", None) == "mistral_common"


def end_of_turn(tokenizer) -> str | None:
    """The special token the tokenizer's chat template writes right after an assistant message, or None when the
    template writes none (then the eos is all a generation can stop on). Raises ConfigError without a template."""
    if is_mistral_common(tokenizer):  # [INST] ... [/INST] answer</s>: mistral-common ends a turn with its eos
        return tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the tokenizer has no chat template (set chat_template in the config, or use a tokenizer "
                          "that has one), so there is no end-of-turn token to find")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": MARKER}]
    text = render(tokenizer, messages, tokenize=False)
    if MARKER not in text:
        return None
    tail = text[text.rindex(MARKER) + len(MARKER):]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for token_id in tokenizer(tail, add_special_tokens=False)["input_ids"]:
        if token_id in special:
            return tokenizer.convert_ids_to_tokens(token_id)
    return None


def stop_ids(tokenizer, eot_tokens: list[str] | None = None) -> list[int]:
    """The token ids a generation should stop on: the eos, the template's end-of-turn token, the config's
    eot_tokens (in that order, without repeats)."""
    eot = None
    if is_mistral_common(tokenizer) or getattr(tokenizer, "chat_template", None):
        try:
            eot = end_of_turn(tokenizer)
        except Exception:  # a template that cannot render this conversation (roles it refuses), or one past its
            eot = None     # time budget (render): the eos alone, and the save completes
    names = [tokenizer.eos_token, eot, *(eot_tokens or [])]
    ids: list[int] = []
    for name in names:
        if not name:
            continue
        token_id = tokenizer.convert_tokens_to_ids(name)
        if isinstance(token_id, int) and token_id >= 0 and token_id != getattr(tokenizer, "unk_token_id", None) \
                and token_id not in ids:
            ids.append(token_id)
    return ids


def generation_config(model_dir: str | Path, tokenizer, base: str | Path | None = None,
                      eot_tokens: list[str] | None = None, start=None):
    """The generation config for a trained model: `start` (a GenerationConfig, e.g. the trained model's own), else
    model_dir's or the base's generation_config.json, else the model config's token ids; with eos_token_id extended
    by stop_ids, pad_token_id set where it was not."""
    # heavy: transformers loads only when this runs
    import copy

    from transformers import GenerationConfig

    gen = copy.deepcopy(start) if start is not None else None
    for source in (model_dir, base) if gen is None else ():
        if source is not None and (Path(source) / "generation_config.json").is_file():
            gen = GenerationConfig.from_pretrained(source)
            break
    if gen is None:
        config_dir = next((s for s in (model_dir, base) if s is not None and (Path(s) / "config.json").is_file()), None)
        if config_dir is not None:
            from transformers import AutoConfig

            gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(config_dir))
        else:
            gen = GenerationConfig()
    have = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    eos = [i for i in have if i is not None]
    eos += [i for i in stop_ids(tokenizer, eot_tokens) if i not in eos]
    gen.eos_token_id = eos if len(eos) > 1 else (eos[0] if eos else None)
    gen._from_model_config = False  # ours, not derived from config.json (generate() would re-derive it)
    if gen.pad_token_id is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    if gen.bos_token_id is None and getattr(tokenizer, "bos_token_id", None) is not None:
        gen.bos_token_id = tokenizer.bos_token_id
    return gen


def write_generation_config(model_dir: str | Path, tokenizer, base: str | Path | None = None,
                            eot_tokens: list[str] | None = None, start=None) -> list[int]:
    """Write model_dir/generation_config.json (atomically) whose eos_token_id includes the chat template's
    end-of-turn token (when the tokenizer has a template); return its eos ids. For final/ (the train loop: pass
    start=model.generation_config) and merged/ (merge-lora)."""
    gen = generation_config(model_dir, tokenizer, base, eot_tokens, start)
    path = Path(model_dir) / "generation_config.json"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(gen.to_json_string(use_diff=True))
    os.replace(tmp, path)
    return gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]


def model_dir_for(cfg, model: str | None) -> Path:
    """--model, else output_dir/merged, else output_dir/final (a full model or an adapter)."""
    if model:
        path = Path(model)
        if not path.is_dir():
            raise ConfigError(f"--model {model}: no such directory")
        return path
    out = Path(cfg.output_dir)
    # start-up: trainer.outputs.made_from imported only when this runs
    from trainer.outputs.made_from import stale_merge

    stale = stale_merge(out)
    if stale:
        raise ConfigError(f"chat-check: {stale} (or pass --model {out / 'final'})")
    for candidate in (out / "merged", out / "final"):
        if candidate.is_dir():
            return candidate
    raise ConfigError(f"no trained model in {out} (neither merged/ nor final/); train first: "
                      "python -m trainer train CONFIG")


def load(cfg, model_dir: Path):
    """(model, tokenizer) on CPU in fp32: a full model directory, or an adapter on the config's base model."""
    # heavy: torch and transformers load only when this runs
    import torch
    import transformers

    # a vision-language model (processor_type) answers a text-only turn through its image-text-to-text class
    AutoModelForCausalLM = getattr(transformers, "AutoModelForImageTextToText" if cfg.processor_type  # noqa: N806
                                   else "AutoModelForCausalLM")
    tokenizer = _tokenizer(cfg, model_dir)
    if (model_dir / "adapter_config.json").is_file():
        from peft import PeftModel

        try:
            base = AutoModelForCausalLM.from_pretrained(cfg.base_model, dtype=torch.float32,
                                                        revision=cfg.revision_of_model,
                                                        trust_remote_code=cfg.trust_remote_code)
        except OSError as err:
            raise ConfigError(f"cannot load the base model {cfg.base_model}: {str(err).splitlines()[0]}") from None
        if len(tokenizer) > base.get_input_embeddings().weight.shape[0]:  # tokens added in training
            base.resize_token_embeddings(len(tokenizer))
        model = PeftModel.from_pretrained(base, str(model_dir))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     trust_remote_code=cfg.trust_remote_code)
    return model.eval(), tokenizer


def _tokenizer(cfg, model_dir: Path):
    # heavy: transformers loads only when this runs
    from transformers import AutoTokenizer

    if cfg.tokenizer_use_mistral_common:
        from transformers.tokenization_mistral_common import MistralCommonBackend

        return MistralCommonBackend.from_pretrained(str(model_dir))
    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot load the tokenizer saved in {model_dir}: {str(err).splitlines()[0]}") from None


def chat_check(cfg, model: str | None = None, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    """Render CONVERSATION with the saved template, generate greedily with the saved generation config, and say
    whether the reply ends with an end-of-turn token. Returns the report (the CLI prints it; `stopped` decides the
    exit code)."""
    # heavy: torch and transformers load only when this runs
    import torch

    model_dir = model_dir_for(cfg, model)
    model, tokenizer = load(cfg, model_dir)
    eot = end_of_turn(tokenizer)
    wanted = stop_ids(tokenizer, cfg.eot_tokens)
    gen = model.generation_config  # a full model's generation_config.json, or the base's under an adapter ...
    if (model_dir / "generation_config.json").is_file():  # ... unless the adapter directory has its own
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_dir)
    saved = [i for i in (gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id])
             if i is not None]
    ids = render(tokenizer, CONVERSATION, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    prompt = torch.tensor([list(ids)])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=saved or None,
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                             else (saved or [0])[0])
    new = out[0, prompt.shape[1]:].tolist()
    eot_id = tokenizer.convert_tokens_to_ids(eot) if eot else None
    emitted_at = next((i for i, t in enumerate(new) if t in wanted), None)
    stopped = emitted_at is not None and emitted_at == len(new) - 1  # ended at its first end-of-turn token
    report = {
        "model": str(model_dir),
        "end_of_turn_token": eot,
        "end_of_turn_id": eot_id,
        "stop_ids": wanted,
        "generation_config_eos_token_id": saved,
        "generation_config_has_end_of_turn": eot_id is None or eot_id in saved,
        "prompt": tokenizer.decode(list(ids)),
        "reply": tokenizer.decode(new),
        "new_tokens": len(new),
        "max_new_tokens": max_new_tokens,
        "stopped": stopped,
    }
    if stopped:
        report["verdict"] = f"stopped with {tokenizer.convert_ids_to_tokens(new[-1])} after {len(new)} tokens"
    elif emitted_at is not None:
        report["verdict"] = (f"wrote {tokenizer.convert_ids_to_tokens(new[emitted_at])} at token {emitted_at + 1} but "
                             f"did not stop: generation_config.json's eos_token_id {saved} does not include it "
                             "(merge-lora and train write it; or add it yourself)")
    else:
        report["verdict"] = (f"did not stop: no end-of-turn token in {max_new_tokens} new tokens (the model has not "
                             "learned to end a turn; train longer, or on data whose turns end with the template's "
                             "end-of-turn token)")
    return report


def print_report(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    print(f"model:        {report['model']}")
    print(f"end of turn:  {report['end_of_turn_token']} (id {report['end_of_turn_id']}); generation_config.json "
          f"eos_token_id {report['generation_config_eos_token_id']}"
          + ("" if report["generation_config_has_end_of_turn"] else " -- MISSING the end-of-turn token"))
    print(f"prompt:       {report['prompt']!r}")
    print(f"reply:        {report['reply']!r}")
    print(f"result:       {report['verdict']}")
