"""A tiny model and tokenizer built locally (no downloads), for smoke runs, examples and tests.

`python -m trainer make-tiny-model DIR [--family llama|qwen2]` writes a 2-layer, hidden-size-64 model
and a byte-level BPE tokenizer (with a ChatML chat template) trained on a few paragraphs of text.
`--family mistral` writes a Mistral model with a mistral-common tokenizer instead (tekken.json, see
build_mistral_tokenizer), for `tokenizer_use_mistral_common: true`.
`--family llava` writes a vision-language model (build_vision_model): transformers' LLaVA architecture (a CLIP
vision tower, a projector, a 2-layer llama language tower) with a processor beside it (the tokenizer above plus
Qwen2-VL's image markers, and transformers' CLIP image processor), for `processor_type: AutoProcessor`;
`--family gemma3_vision` a Gemma 3 vision-language model the same way (build_gemma3_vision).
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.data.formats.prompts import CHATML_TEMPLATE

CORPUS = """\
Below is an instruction that describes a task. Write a response that appropriately completes the request.
### Instruction: ### Input: ### Response: user assistant system
The quick brown fox jumps over the lazy dog. A tiny model learns to repeat what it sees.
Paris is the capital of France. Rome is the capital of Italy. Berlin is the capital of Germany.
Water boils at one hundred degrees. Two plus two is four. Three times three is nine.
Translate the sentence. Summarize the text. Answer the question. Write a short poem about the sea.
The sun rises in the east and sets in the west. Cats sleep a lot. Dogs like to play fetch.
"""

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(texts: list[str] | None = None, vocab_size: int = 384):
    # heavy: tokenizers and transformers load only when this runs
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts or CORPUS.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_mistral_tokenizer(out_dir: str | Path, version: str = "v13", vocab: int = 1500,
                            special: int = 64) -> Path:
    """A real mistral-common tokenizer file, cut down from the tekken file mistral-common ships
    (mistral_common/data/tekken_240911.json): its first `vocab` byte-level BPE ranks, `special` control tokens
    (mistral-common's own, in its order, then fillers) and the instruct format of `version` (v3: system prompt
    in the last user turn; v7+: [SYSTEM_PROMPT]; v13: thinking chunks). Tekken cuts a vocabulary to its first
    ranks itself (config.default_vocab_size), so this is the same tokenizer with fewer merges. Needs the
    mistral-common package. Returns the path of tekken.json."""
    # optional: mistral_common is imported only where it is used
    import mistral_common
    from mistral_common.tokens.tokenizers.base import SpecialTokens
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    source = json.loads((Path(mistral_common.__file__).parent / "data" / "tekken_240911.json").read_text())
    names = [t["token_str"] for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS]
    names += [t.value for t in SpecialTokens if t.value not in names]
    names += [Tekkenizer.SPECIAL_TOKEN_TEMPLATE.format(id=i) for i in range(len(names), special)]
    config = dict(source["config"], version=version, num_vocab_tokens=vocab, default_vocab_size=special + vocab,
                  default_num_special_tokens=special)
    tekken = {"config": config, "vocab": source["vocab"][:vocab],
              "special_tokens": [{"rank": i, "token_str": name, "is_control": True} for i, name in enumerate(names)]}
    path = Path(out_dir) / "tekken.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tekken))
    return path


# Mixture-of-experts families: 4 routed experts, 2 per token (transformers 5 stores them as fused 3-D parameters,
# experts.gate_up_proj and experts.down_proj, as the real Mixtral and Qwen3-MoE checkpoints load)
MOE = {"mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
       "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "head_dim": 16}}


def build_model(tokenizer, family: str = "llama", seed: int = 0, hidden_size: int = 64, layers: int = 2):
    # heavy: torch and transformers load only when this runs
    import torch
    from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config,
                              Qwen3MoeConfig)

    configs = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "mixtral": MixtralConfig,
               "qwen3_moe": Qwen3MoeConfig}
    if family not in configs:
        raise ValueError(f"family must be one of {sorted(configs)}")
    config = configs[family](
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, **MOE.get(family, {}))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# The image markers the tiny vision model's tokenizer carries: Qwen2-VL's, so Axolotl's qwen2_vl chat template (and
# its role boundaries, matrices/vision.toml) render and mask its conversations as they do Qwen2-VL's
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
IMAGE_SIDE = 28  # the vision tower's image size: 2x2 patches of 14 pixels, 4 image tokens per image


def build_vision_model(tokenizer, seed: int = 0, hidden_size: int = 64, layers: int = 2):
    """A LLaVA model (transformers' LlavaConfig: CLIP vision config + llama text config) sized for a CPU test."""
    # heavy: torch and transformers load only when this runs
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=IMAGE_SIDE, patch_size=14, projection_dim=32),
        image_token_index=tokenizer.convert_tokens_to_ids("<|image_pad|>"), vision_feature_layer=-1,
        vision_feature_select_strategy="default", projector_hidden_act="gelu", tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config).to(torch.float32)


def build_processor(tokenizer):
    """LlavaProcessor: the tokenizer and transformers' CLIP image processor (its PIL backend: no torchvision)."""
    # heavy: transformers loads only when this runs
    from transformers import LlavaProcessor

    try:
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:  # transformers without the PIL backends' own names
        from transformers import CLIPImageProcessor as ImageProcessor
    images = ImageProcessor(size={"shortest_edge": IMAGE_SIDE}, crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14, image_token="<|image_pad|>",
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)


GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def build_gemma3_vision(texts: list[str] | None = None, seed: int = 0, hidden_size: int = 64, layers: int = 2):
    """(model, processor): transformers' Gemma 3 (a SigLIP vision tower, its projector, a Gemma 3 language tower)
    with Gemma's turn and image markers on the tokenizer above; 4 image tokens per image, as LLaVA's above."""
    # heavy: torch and transformers load only when this runs
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, PreTrainedTokenizerFast

    try:
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import Gemma3ImageProcessor as ImageProcessor
    base = build_tokenizer(texts)
    base.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>", *GEMMA3_TOKENS.values()]},
                            replace_extra_special_tokens=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", extra_special_tokens=GEMMA3_TOKENS)
    from trainer.data.formats.chat_templates import template_text

    tokenizer.chat_template = template_text("gemma3")
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA3_TOKENS.items()}
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=4096, sliding_window=64, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=IMAGE_SIDE, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"])
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    # transformers initialises the projector's input projection to zeros (a trained checkpoint replaces it): drawn
    # here, so the images reach the language tower and the vision tower gets gradients
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    images = ImageProcessor(size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
    return model, Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=4)


def make_tiny_model(out_dir: str | Path, family: str = "llama", texts: list[str] | None = None, seed: int = 0) -> Path:
    out_dir = Path(out_dir)
    if family == "gemma3_vision":
        model, processor = build_gemma3_vision(texts, seed)
        model.save_pretrained(out_dir)
        processor.save_pretrained(out_dir)
        return out_dir
    if family == "llava":  # a vision-language model and its processor (processor_config.json beside the weights)
        tokenizer = build_tokenizer(texts)
        tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS}, replace_extra_special_tokens=False)
        build_vision_model(tokenizer, seed).save_pretrained(out_dir)
        build_processor(tokenizer).save_pretrained(out_dir)
        return out_dir
    if family == "mistral":  # the tokenizer is mistral-common's (texts do not apply: tekken is pre-trained)
        # heavy: transformers loads only when this runs
        from transformers.tokenization_mistral_common import MistralCommonBackend

        tokenizer = MistralCommonBackend(build_mistral_tokenizer(out_dir))
        build_model(tokenizer, family, seed).save_pretrained(out_dir)
        return out_dir
    tokenizer = build_tokenizer(texts)
    model = build_model(tokenizer, family, seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
