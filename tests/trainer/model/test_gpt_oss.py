"""Axolotl's gpt-oss examples on a tiny local gpt-oss: MXFP4 experts loaded dequantized through transformers'
Mxfp4Config (model_quantization_config), reasoning text mapped into the chat template (field_thinking,
template_thinking_key) and trained with its turn, and the attention backend the gpt-oss class accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trl

from tests.trainer.helpers import train_then_resume, write_jsonl
from trainer.batch.labels import IGNORE
from trainer.cli import main
from trainer.config import DatasetConfig, parse_config
from trainer.data.formats.prompts import tokenize_row
from trainer.errors import ConfigError
from trainer.model.attention import for_model
from trainer.runtime.hardware import adapt, gpu_from_name

# The gpt-oss chat template as TRL ships it (trl/chat_templates/gptoss.jinja, OpenAI's template): it renders a
# message's `thinking` as the analysis channel of the final assistant turn.
GPT_OSS_TEMPLATE = Path(trl.__file__).parent / "chat_templates" / "gptoss.jinja"
GPT_OSS_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"]
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode an expert weight [experts, in, out] as gpt-oss checkpoints store it (OCP MX: blocks of 32 values
    along `in`, FP4 e2m1 codes two per byte, low nibble first, one shared power-of-two scale per block stored
    as exponent + 127). Returns blocks [experts, out, in/32, 16], scales [experts, out, in/32], and the weight
    those decode to: the oracle the loaded model is compared with."""
    t = weight.transpose(1, 2).contiguous()
    experts, rows, cols = t.shape
    groups = t.reshape(experts, rows, cols // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-12) / 6.0)).to(torch.int32)
    scale = torch.ldexp(torch.ones(exponent.shape), exponent)[..., None]
    codes = ((groups / scale)[..., None] - FP4).abs().argmin(-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    decoded = (FP4[codes] * scale).reshape(experts, rows, cols).transpose(1, 2).contiguous()
    return blocks, (exponent + 127).to(torch.uint8), decoded


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A 2-layer gpt-oss (4 experts, a sliding and a full attention layer, attention sinks) whose experts are
    stored in MXFP4 with config.json's quantization_config, as openai/gpt-oss-20b ships; the tokenizer carries
    the gpt-oss chat template and its special tokens."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GptOssConfig

    from trainer.model.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("tiny-gpt-oss")
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": GPT_OSS_TOKENS})
    tokenizer.chat_template = GPT_OSS_TEMPLATE.read_text()
    config = GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    weights, expected = load_file(out / "model.safetensors"), {}
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weights[f"{name}_blocks"], weights[f"{name}_scales"], expected[name] = mxfp4(weights.pop(name).float())
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    meta = json.loads((out / "config.json").read_text())
    meta["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(meta))
    return out, expected


def _thinking_rows(n: int) -> list[dict]:
    """HuggingFaceH4/Multilingual-Thinking's shape: messages with a `thinking` field on the assistant turn."""
    return [{"messages": [{"role": "system", "content": "reasoning language: French"},
                          {"role": "user", "content": f"Repeat {i}: the quick brown fox"},
                          {"role": "assistant", "thinking": f"the user asks to repeat {i} the fox",
                           "content": "the quick brown fox " * (1 + i % 3)}]} for i in range(n)]


def test_model_quantization_config_maps_to_transformers_mxfp4config_and_refuses_the_rest():
    from transformers import Mxfp4Config

    from trainer.model.quantization_config import build

    built = build("Mxfp4Config", {"dequantize": True})
    assert isinstance(built, Mxfp4Config) and built.dequantize is True
    base = {"base_model": "tiny", "datasets": [{"path": "d.jsonl", "type": "completion"}]}
    for bad, reason in [({"model_quantization_config": "GPTQConfig"}, "'GPTQConfig' is not supported"),
                        ({"model_quantization_config": "Mxfp4Config"}, "needs model_quantization_config_kwargs.dequantize: true"),
                        ({"model_quantization_config": "Mxfp4Config", "load_in_4bit": True, "adapter": "qlora",
                          "model_quantization_config_kwargs": {"dequantize": True}}, "two quantizations")]:
        with pytest.raises(ConfigError, match=reason):
            parse_config({**base, **bad})


def test_mxfp4_experts_load_as_the_weights_their_blocks_encode(tiny_gpt_oss, tmp_path):
    """load_model with Axolotl's keys: every expert weight is exactly its MXFP4 decoding (random init or the
    unquantized weights would differ), full precision, and trainable."""
    from trainer.data.prepare import load_tokenizer
    from trainer.model.load import load_model

    model_dir, expected = tiny_gpt_oss
    cfg, _ = parse_config({"base_model": str(model_dir), "datasets": [{"path": "d.jsonl", "type": "completion"}],
                           "model_quantization_config": "Mxfp4Config",
                           "model_quantization_config_kwargs": {"dequantize": True}})
    runtime = adapt(cfg, gpu_from_name("cpu"))
    for_model(cfg, runtime, local_only=True)  # sdpa -> eager, as train does before loading
    model = load_model(cfg, runtime, load_tokenizer(cfg))
    params = dict(model.named_parameters())
    for name, weight in expected.items():
        assert params[name].dtype == torch.float32 and params[name].requires_grad
        assert torch.equal(params[name].detach(), weight), name
    assert not torch.equal(expected["model.layers.0.mlp.experts.down_proj"], torch.zeros(4, 64, 64))


def test_the_gpt_oss_class_gets_an_attention_backend_it_accepts(tiny_gpt_oss):
    """gpt-oss has no sdpa path and runs flash attention only through kernels that apply its sinks: the
    hardware's choice is fitted to the class (transformers would otherwise fetch a Hub kernel on its own)."""
    model_dir, _ = tiny_gpt_oss
    cases = [("cpu", "sdpa", "eager"), ("a100", "flash_attention_2", "flex_attention"),
             ("h100", "flash_attention_2", "kernels-community/vllm-flash-attn3"), ("t4", "sdpa", "eager")]
    for gpu, hardware_choice, expected in cases:
        cfg, _ = parse_config({"base_model": str(model_dir), "attn_implementation": hardware_choice,
                               "datasets": [{"path": "d.jsonl", "type": "completion"}]})
        runtime = adapt(cfg, gpu_from_name(gpu))
        assert runtime.attention == hardware_choice
        notes = for_model(cfg, runtime, local_only=True)
        assert runtime.attention == expected and notes and "GptOssForCausalLM" in notes[0], (gpu, notes)
        assert for_model(cfg, runtime, local_only=True) == []  # settled: a second look changes nothing


def test_thinking_is_rendered_from_field_thinking_and_trained_with_the_assistant_turn(tiny_gpt_oss):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt_oss[0])
    row = _thinking_rows(1)[0]

    def trained_text(**keys) -> tuple[str, str]:
        ds = DatasetConfig(path="d.jsonl", type="chat_template", **keys)
        out = tokenize_row(row, ds, tokenizer, train_on_inputs=False, eot_tokens=["<|end|>"])
        trained = [t for t, label in zip(out["input_ids"], out["labels"]) if label != IGNORE]
        return tokenizer.decode(out["input_ids"]), tokenizer.decode(trained)

    text, trained = trained_text(field_thinking="thinking", template_thinking_key="thinking")
    assert "<|channel|>analysis<|message|>the user asks to repeat 0 the fox<|end|>" in text
    # the turn trains from its first text (the reasoning) to its end, as Axolotl's chat_template strategy locates
    # a turn (exactly so for Qwen3: tests/trainer/data/test_turn_flags.py); Axolotl's token search here also trains
    # the two tokens 'analysis<|message|>' before the reasoning and leaves out the final <|return|>
    assert trained == ("the user asks to repeat 0 the fox<|end|><|start|>assistant"
                       "<|channel|>final<|message|>the quick brown fox <|return|>")  # thinking, answer, end
    assert "Repeat 0" not in trained and "French" not in trained
    # Axolotl's defaults map `reasoning_content`, which this data lacks: no analysis channel at all
    text, trained = trained_text()
    assert "<|channel|>analysis" not in text and trained == "the quick brown fox <|return|>"


def test_qwen3s_template_renders_reasoning_content_by_axolotls_defaults(tiny_gpt_oss):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt_oss[0])
    row = {"messages": [{"role": "user", "content": "Two plus two?"},
                        {"role": "assistant", "reasoning_content": "add them", "content": "four"}]}
    ds = DatasetConfig(path="d.jsonl", type="chat_template", chat_template="qwen3")
    out = tokenize_row(row, ds, tokenizer, train_on_inputs=False)
    trained = tokenizer.decode([t for t, label in zip(out["input_ids"], out["labels"]) if label != IGNORE])
    # from the reasoning text on, as Axolotl's find_turn (the generation header's "<think>" is the prompt's)
    assert trained.startswith("add them\n</think>\n\nfour") and "Two plus two" not in trained


@pytest.mark.slow
def test_a_gpt_oss_example_shaped_config_trains_and_resumes_exactly(tiny_gpt_oss, make_config, tmp_path):
    """Axolotl's examples/gpt-oss/gpt-oss-20b-sft-lora-singlegpu.yaml with a tiny local gpt-oss and local data:
    MXFP4 dequantized, the Hub FA3 kernel (sdpa on CPU, then eager: the gpt-oss class has no sdpa), thinking
    trained, packed, LoRA on every linear layer, checkpointing; the resumed run repeats the later steps. The
    example's adamw_torch_8bit needs torchao, which CI does not install (the optimizer tests cover it)."""
    model_dir, _ = tiny_gpt_oss
    data = write_jsonl(tmp_path / "thinking.jsonl", _thinking_rows(24))
    common = dict(base_model=str(model_dir), model_quantization_config="Mxfp4Config",
                  model_quantization_config_kwargs={"dequantize": True}, use_kernels=True,
                  plugins=["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"],
                  datasets=[{"path": str(data), "type": "chat_template", "field_thinking": "thinking",
                             "template_thinking_key": "thinking"}],
                  sample_packing=True, adapter="lora", lora_r=4, lora_alpha=8, lora_dropout=0.0,
                  lora_target_linear=True, optimizer="adamw_torch", lr_scheduler="constant_with_warmup",
                  warmup_ratio=0.1, attn_implementation="kernels-community/vllm-flash-attn3",
                  gradient_checkpointing=True, activation_offloading=True, eot_tokens=["<|end|>"],
                  max_steps=4, save_steps=2, sequence_len=512)
    full, _ = train_then_resume(main, make_config, tmp_path, **common)
    losses = [json.loads(line)["loss"] for line in (full / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert (full / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_validate_shows_the_gpt_oss_fit_on_an_a100(tiny_gpt_oss, tmp_path):
    """The example's Hub FA3 kernel on an A100: the hardware's fallback (flash_attention_2), then the gpt-oss
    class's own (flex_attention, which applies its sinks), both explained; the model's config is local."""
    from tests.trainer.helpers import run_cli

    config, data = tmp_path / "gpt-oss.yml", write_jsonl(tmp_path / "thinking.jsonl", _thinking_rows(2))
    config.write_text(json.dumps({
        "base_model": str(tiny_gpt_oss[0]), "learning_rate": 2e-5, "attn_implementation": "kernels-community/vllm-flash-attn3",
        "model_quantization_config": "Mxfp4Config", "model_quantization_config_kwargs": {"dequantize": True},
        "datasets": [{"path": str(data), "type": "chat_template", "field_thinking": "thinking",
                      "template_thinking_key": "thinking"}]}))
    result = run_cli("validate", str(config), "--gpu", "a100", "--json", env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    runtime = json.loads(result.stdout)["runtime"]
    assert runtime["attention"] == "flex_attention"
    assert any(c.startswith("attention: kernels-community/vllm-flash-attn3 -> flash_attention_2") for c in runtime["changes"])
    assert any(c.startswith("attention: flash_attention_2 -> flex_attention (GptOssForCausalLM") for c in runtime["changes"])


def test_packed_gpt_oss_rows_get_each_layers_own_mask(tiny_gpt_oss):
    """gpt-oss alternates sliding-window (16 tokens here) and full layers, and its forward does not pass
    position_ids to its mask creation. The trainer's model gives every layer type its own mask, per packed
    sequence: packed logits equal each sequence run alone by transformers with its own masks (the oracle).
    A single 4D mask (the collator's) would differ by ~0.4 here: sliding layers would see past their window."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from trainer.batch.collate import Collator
    from trainer.data.prepare import load_tokenizer
    from trainer.model.load import load_model

    model_dir, _ = tiny_gpt_oss
    cfg, _ = parse_config({"base_model": str(model_dir), "datasets": [{"path": "d.jsonl", "type": "completion"}],
                           "model_quantization_config": "Mxfp4Config",
                           "model_quantization_config_kwargs": {"dequantize": True}})
    runtime = adapt(cfg, gpu_from_name("cpu"))
    for_model(cfg, runtime, local_only=True)
    model = load_model(cfg, runtime, load_tokenizer(cfg)).eval()
    oracle = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32,
                                                  quantization_config=Mxfp4Config(dequantize=True)).eval()
    g = torch.Generator().manual_seed(0)
    rows = [[{"input_ids": torch.randint(5, 300, (n,), generator=g).tolist(), "labels": [1] * n} for n in lengths]
            for lengths in ([20, 25], [30])]  # longer than the window; the second row is padded
    batch = Collator(pad_token_id=0, attention=runtime.attention)(rows)
    with torch.no_grad():
        packed = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}, use_cache=False).logits
        for r, row in enumerate(rows):
            start = 0
            for example in row:
                alone = oracle(torch.tensor([example["input_ids"]]), use_cache=False).logits[0]
                n = len(example["input_ids"])
                assert (packed[r, start:start + n] - alone).abs().max().item() < 1e-5, (r, start)
                start += n
