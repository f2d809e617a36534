"""After training: merge-lora, export --format gguf and chat-check, through the commands a user types.

Oracles: peft (the adapter on the base, PeftModel.from_pretrained) for the merge; transformers' own GGUF reader
(from_pretrained(..., gguf_file=)) and gguf.GGUFReader for the export; generate() with the saved
generation_config.json for chat-check. Tiny local models trained for a few steps on CPU.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.trainer.after_helpers import peak_rise, write_sharded_model
from tests.trainer.helpers import REPO, alpaca_rows, run_cli, write_jsonl
from trainer.cli import main
from trainer.model.tiny import build_model, build_tokenizer, make_tiny_model

pytestmark = pytest.mark.slow

COMMON = {"sequence_len": 128, "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-2,
          "lr_scheduler": "constant", "attn_implementation": "sdpa", "seed": 1}
LORA = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True}
QA = [("What is the capital of France?", "Paris."), ("What is the capital of Italy?", "Rome."),
      ("What is the capital of Germany?", "Berlin."), ("Two plus two?", "Four.")]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("after")


@pytest.fixture(scope="module")
def data(work) -> dict[str, Path]:
    chat = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QA] * 8
    return {"alpaca": write_jsonl(work / "alpaca.jsonl", alpaca_rows(48)),
            "chat": write_jsonl(work / "chat.jsonl", chat),
            "pairs": REPO / "examples" / "data" / "tiny-pairs.jsonl"}


@pytest.fixture(scope="module")
def models(work) -> dict[str, Path]:
    """The tiny models make-tiny-model writes, and a Mistral with the tiny Hugging Face tokenizer (make-tiny-model's
    Mistral has mistral-common's)."""
    out = {family: make_tiny_model(work / f"tiny-{family}", family=family) for family in ("llama", "qwen2", "mistral")}
    tokenizer = build_tokenizer()
    build_model(tokenizer, "mistral").save_pretrained(work / "tiny-mistral-hf")
    tokenizer.save_pretrained(work / "tiny-mistral-hf")
    out["mistral-hf"] = work / "tiny-mistral-hf"
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)  # Qwen3 with its usual head size, 128 (transformers' GGUF reader assumes it for qwen3)
    AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)).save_pretrained(work / "tiny-qwen3")
    tokenizer.save_pretrained(work / "tiny-qwen3")
    out["qwen3"] = work / "tiny-qwen3"
    return out


def write_config(work: Path, name: str, **keys) -> Path:
    cfg = {"dataset_prepared_path": str(work / "prepared"), "output_dir": str(work / name), **COMMON, **keys}
    path = work / f"{name}.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


RUNS = {  # name -> (model, dataset, extra keys): each trains for 2 steps once per module
    "llama-lora-added-token": ("llama", "alpaca", {**LORA, "tokens": ["<extra1>"]}),
    "qwen2-dora-rslora-lm-head": ("qwen2", "alpaca", {**LORA, "peft_use_dora": True, "peft_use_rslora": True,
                                                      "lora_target_linear": None,
                                                      "lora_target_modules": ["q_proj", "v_proj", "gate_proj"],
                                                      "lora_modules_to_save": ["lm_head"]}),
    "llama-dpo": ("llama", "pairs", {**LORA, "rl": "dpo", "rl_beta": 0.1}),
    "mistral-hf-full": ("mistral-hf", "alpaca", {}),
    "qwen3-full": ("qwen3", "alpaca", {}),
    "mistral-qlora-mistral-common": ("mistral", "chat", {**LORA, "adapter": "qlora", "load_in_4bit": True,
                                                         "tokenizer_use_mistral_common": True}),
}


@pytest.fixture(scope="module")
def trained(work, data, models):
    """run name -> its config, trained on first use."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            model, dataset, keys = RUNS[name]
            ds = {"path": str(data[dataset]), "type": "alpaca"}
            if dataset == "pairs":
                ds = {"path": str(data[dataset]), "type": "chat_template.default", "field_messages": "messages",
                      "field_chosen": "chosen", "field_rejected": "rejected"}
            elif dataset == "chat":
                ds = {"path": str(data[dataset]), "type": "chat_template"}
            keys = {k: v for k, v in keys.items() if v is not None}
            config = write_config(work, name, base_model=str(models[model]), datasets=[ds], **keys)
            assert main(["train", str(config)]) == 0
            done[name] = config
        return done[name]

    return get


def output_dir(config: Path) -> Path:
    return Path(yaml.safe_load(config.read_text())["output_dir"])


def logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits.float()


def peft_oracle(base: Path, final: Path, tokenizer_len: int, quantization=None):
    """The trained model as peft assembles it: the base in fp32 (optionally 4-bit), resized for added tokens,
    with the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    extra = {"quantization_config": quantization} if quantization is not None else {}
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **extra)
    if tokenizer_len > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(tokenizer_len)
    return model, PeftModel.from_pretrained(model, str(final))


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


# ---- merge-lora ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("run", ["llama-lora-added-token", "qwen2-dora-rslora-lm-head", "llama-dpo"])
def test_merged_model_is_the_base_plus_adapter_as_peft_computes_it(trained, models, run):
    """`python -m trainer merge-lora CONFIG` writes output_dir/merged; its logits are peft's (base + adapter) on a
    fixed batch to 1e-4 in fp32, for an SFT adapter with an added token (embeddings saved whole), DoRA + rsLoRA with
    lm_head in modules_to_save, and a DPO adapter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = trained(run)
    out = output_dir(config)
    result = run_cli("merge-lora", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"written to {out / 'merged'}" in result.stdout
    merged = out / "merged"
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
            "generation_config.json"} <= {p.name for p in merged.iterdir()}
    assert not list(out.glob(".merged.tmp-*"))
    tokenizer = AutoTokenizer.from_pretrained(merged)
    gen = json.loads((merged / "generation_config.json").read_text())
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]  # the template's end of turn
    assert tokenizer.eos_token_id in gen["eos_token_id"]

    base, oracle = peft_oracle(models[RUNS[run][0]], out / "final", len(tokenizer))
    ids = batch(len(tokenizer))
    expected = logits(oracle, ids)
    with oracle.disable_adapter():
        before = logits(oracle, ids)
    got = logits(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), ids)
    assert (expected - before).abs().max() > 1e-3  # the adapter changes the model, so the comparison can fail
    assert (got - expected).abs().max() <= 1e-4


def test_qlora_merges_into_the_unquantized_base(trained, models, work):
    """QLoRA (4-bit base, mistral-common tokenizer): the merged weights are the checkpoint's own plus the LoRA
    deltas in the training precision (fp32 here), never 4-bit: equal to peft on the fp32 base to 1e-4; against the
    4-bit base + adapter the run trained, the difference is the base's own NF4 rounding (within 1.5x of the fp32 vs
    4-bit base difference on the same batch)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = trained("mistral-qlora-mistral-common")
    out = output_dir(config)
    assert main(["merge-lora", str(config)]) == 0
    merged = out / "merged"
    with safe_open(merged / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    assert (merged / "tekken.json").read_bytes() == (models["mistral"] / "tekken.json").read_bytes()
    assert json.loads((merged / "generation_config.json").read_text())["eos_token_id"] == 2  # </s> ends a turn

    ids = batch(1000)
    got = logits(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), ids)
    base32, exact = peft_oracle(models["mistral"], out / "final", 0)
    assert (got - logits(exact, ids)).abs().max() <= 1e-4
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32, bnb_4bit_use_double_quant=True,
                             bnb_4bit_quant_type="nf4")  # as trainer.quantization builds it for load_in_4bit
    base4, trained4 = peft_oracle(models["mistral"], out / "final", 0, quantization=nf4)
    with exact.disable_adapter():
        fp32_base = logits(exact, ids)
    with trained4.disable_adapter():
        rounding = (fp32_base - logits(trained4, ids)).abs().max()
    assert 0 < (got - logits(trained4, ids)).abs().max() <= 1.5 * rounding

    result = run_cli("export", str(config), "--outtype", "f32")  # mistral-common has no tokenizer.json to write
    assert result.returncode == 2 and "tekken.json" in one_line(result.stderr)
    assert not list(out.glob("*.gguf*"))


def test_a_full_fine_tune_has_nothing_to_merge(trained):
    config = trained("mistral-hf-full")
    result = run_cli("merge-lora", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nothing to merge" in result.stdout
    assert not (output_dir(config) / "merged").exists()


def test_merge_streams_one_shard_at_a_time(work, data):
    """A model written in 11 shards merges with a peak RSS rise of about one shard, well under the model's size
    (a subprocess's ru_maxrss before and after, libraries imported first); loading the model whole, the control,
    rises by the model's size. bench/bench_merge_memory.py prints the same figures."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = work / "sharded"
    size = write_sharded_model(base, hidden=512, layers=12, shard="12MB")
    shards = sorted(p.name for p in base.glob("*.safetensors"))
    assert len(shards) >= 8
    config = write_config(work, "sharded-run", base_model=str(base), **{**LORA, "max_steps": 1},
                          datasets=[{"path": str(data["alpaca"]), "type": "alpaca"}])
    assert main(["train", str(config)]) == 0
    merge = peak_rise("merge", str(config))
    control = peak_rise("load", str(base))
    assert merge["rc"] == 0
    assert control["peak_rise_bytes"] > 0.9 * size  # the measurement sees a whole model when there is one
    assert merge["peak_rise_bytes"] < 0.5 * size
    merged = output_dir(config) / "merged"
    assert sorted(p.name for p in merged.glob("*.safetensors")) == shards
    _, oracle = peft_oracle(base, output_dir(config) / "final", len(AutoTokenizer.from_pretrained(base)))
    ids = batch(300)
    got = logits(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), ids)
    assert (got - logits(oracle, ids)).abs().max() <= 1e-4


# ---- export --format gguf ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("run,outtype,tolerance", [
    ("llama-lora-added-token", "f32", 1e-3),  # llama: q/k rows permuted as llama.cpp does, undone by transformers
    ("mistral-hf-full", "f32", 1e-3),  # a full fine-tune's final/, written as llama.cpp's `llama` architecture
    ("qwen2-dora-rslora-lm-head", "q8_0", 2e-2),  # q8_0: 8-bit blocks of 32, measured 8e-3 on these models
    ("qwen3-full", "f16", 1e-3),  # f16 weights: measured 3e-4; qwen3's per-head q/k norms
])
def test_gguf_round_trip(trained, run, outtype, tolerance):
    """`export --format gguf` writes one file that transformers loads back (from_pretrained(dir, gguf_file=)) with
    the model's logits, tokenizes like the saved tokenizer, and whose metadata (gguf.GGUFReader) carries the chat
    template, the eos and the end-of-turn ids."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = trained(run)
    out = output_dir(config)
    if not (out / "final" / "config.json").is_file() and not (out / "merged").is_dir():
        assert main(["merge-lora", str(config)]) == 0
    source = out / "merged" if (out / "merged").is_dir() else out / "final"
    result = run_cli("export", str(config), "--format", "gguf", "--outtype", outtype)
    assert result.returncode == 0, result.stderr[-3000:]
    path = out / f"{out.name}-{outtype}.gguf"
    assert f"wrote {path}" in result.stdout
    assert not list(out.glob(".*.gguf.tmp-*"))

    tokenizer = AutoTokenizer.from_pretrained(source)
    reader = gguf.GGUFReader(path)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    model_type = json.loads((source / "config.json").read_text())["model_type"]
    assert field("general.architecture") == {"llama": "llama", "mistral": "llama", "qwen2": "qwen2",
                                                "qwen3": "qwen3"}[model_type]
    assert field("tokenizer.chat_template") == tokenizer.chat_template
    assert field("tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert field("tokenizer.ggml.eot_token_id") == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert field("general.file_type") == {"f32": 0, "f16": 1, "q8_0": 7}[outtype]
    # the tiny Qwen2's tokenizer is transformers' Qwen2Tokenizer, which splits with Qwen2's regex (as Qwen2/Qwen3
    # checkpoints' tokenizer.json do): llama.cpp's `qwen2`; the others split with ByteLevel's own: `gpt-2`
    assert field("tokenizer.ggml.pre") == ("qwen2" if run.startswith("qwen2") else "gpt-2")

    source_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    back = AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32)
    ids = batch(len(tokenizer))
    assert (logits(back, ids) - logits(source_model, ids)).abs().max() <= tolerance
    text = "<|im_start|>user\nParis is the capital of France, 123 times.\n\n  It's 42!<|im_end|>\n"
    assert AutoTokenizer.from_pretrained(out, gguf_file=path.name)(text)["input_ids"] == tokenizer(text)["input_ids"]


# ---- a model that stops --------------------------------------------------------------------------------------------

def test_chat_check_reports_whether_the_model_stops(work, data, models):
    """A LoRA run on short chat answers learns to end its turn with <|im_end|>. With the base's
    generation_config.json (eos </s> only) generation runs past it: chat-check exits 1 and says why. merge-lora
    writes eos_token_id [</s>, <|im_end|>]: the merged model stops, chat-check exits 0."""
    config = write_config(work, "stops", base_model=str(models["llama"]), **{**LORA, "lora_r": 16, "lora_alpha": 32},
                          datasets=[{"path": str(data["chat"]), "type": "chat_template"}],
                          max_steps=40, micro_batch_size=4, learning_rate=2e-2, sequence_len=64)
    assert main(["train", str(config)]) == 0
    out = output_dir(config)
    (out / "final" / "generation_config.json").unlink(missing_ok=True)  # as before train wrote one: the base's
    result = run_cli("chat-check", str(config), "--model", str(out / "final"), "--json")
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["end_of_turn_token"] == "<|im_end|>" and report["generation_config_eos_token_id"] == [1]
    assert "<|im_end|>" in report["reply"] and not report["stopped"] and "does not include it" in report["verdict"]

    assert main(["merge-lora", str(config)]) == 0
    result = run_cli("chat-check", str(config))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "stopped with <|im_end|>" in result.stdout


@pytest.mark.parametrize("template,expected", [
    ("chatml", "<|im_end|>"), ("qwen3", "<|im_end|>"), ("llama3", "<|eot_id|>"), ("llama4", "<|eot|>"),
    ("gemma", "<end_of_turn>"), ("gemma4", "<turn|>"), ("phi_3", "<|end|>"), ("mistral_v1", "</s>"),
    ("cohere", "<|END_OF_TURN_TOKEN|>"), ("exaone", "[|endofturn|]"),
])
def test_the_end_of_turn_token_is_read_from_the_template(template, expected):
    """What the bundled template (trainer/templates, from each model's tokenizer_config) writes after an assistant
    message, found by rendering it, for templates whose end of turn is not the eos."""
    from trainer.outputs.chat_check import end_of_turn

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [expected, "<|start_header_id|>", "<|end_header_id|>",
                                                                "<start_of_turn>", "<|header_start|>", "<|header_end|>",
                                                                "<|turn>", "<|user|>", "<|assistant|>"]},
                                 replace_extra_special_tokens=False)
    tokenizer.chat_template = (REPO / "trainer" / "templates" / f"{template}.jinja").read_text()
    assert end_of_turn(tokenizer) == expected


# ---- bad input: one line, the documented exit code, nothing written ------------------------------------------------

def test_merge_bad_input(trained, work, capsys):
    adapter = output_dir(trained("llama-lora-added-token")) / "final"

    def merge(name: str, **keys) -> tuple[int, str, Path]:
        config = write_config(work, name, base_model=keys.pop("base_model", str(work / "tiny-llama")),
                              datasets=[{"path": str(work / "alpaca.jsonl"), "type": "alpaca"}], **LORA, **keys)
        code = main(["merge-lora", str(config)])
        return code, one_line(capsys.readouterr().err), output_dir(config)

    code, line, _ = merge("never-trained")
    assert code == 2 and "no trained output" in line and "python -m trainer train" in line
    (work / "empty-final" / "final").mkdir(parents=True)
    code, line, _ = merge("empty-final")
    assert code == 2 and "holds no adapter" in line
    for name, base, says in (("no-base", str(work / "missing-model"), "not found"),  # the config reader says it
                             ("offline-hub", "no-such-org/no-such-model", "is not available here")):
        shutil.copytree(adapter, work / name / "final")
        code, line, out = merge(name, base_model=base)
        assert code == 2 and says in line
        assert sorted(p.name for p in out.iterdir()) == ["final"]  # nothing written
    shutil.copytree(adapter, work / "exists" / "final")
    (work / "exists" / "merged").mkdir()
    (work / "exists" / "merged" / "keep.txt").write_text("mine")
    code, line, out = merge("exists")
    assert code == 2 and "already exists" in line
    assert [p.name for p in (out / "merged").iterdir()] == ["keep.txt"]


def test_a_merge_that_fails_midway_leaves_nothing(work, capsys):
    """A base whose second shard is cut short: the first shard merges, the second cannot be read (exit 1, one
    line), and neither merged/ nor its temporary directory is left."""
    from peft import LoraConfig, get_peft_model

    base, run = work / "broken-base", work / "broken"
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, "llama", hidden_size=64, layers=4)
    model.save_pretrained(base, max_shard_size="100KB")
    tokenizer.save_pretrained(base)
    adapter = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    adapter.save_pretrained(run / "final")
    tokenizer.save_pretrained(run / "final")
    shard = sorted(base.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    config = write_config(work, "broken", base_model=str(base), **LORA,
                          datasets=[{"path": str(work / "alpaca.jsonl"), "type": "alpaca"}])
    assert main(["merge-lora", str(config), "--dtype", "fp32"]) == 1
    one_line(capsys.readouterr().err)
    assert sorted(p.name for p in run.iterdir()) == ["final"]


def test_export_bad_input(trained, work, models, capsys):
    def export(config: Path, *args: str) -> tuple[int, str]:
        code = main(["export", str(config), *args])
        return code, one_line(capsys.readouterr().err)

    shutil.copytree(output_dir(trained("llama-dpo")) / "final", work / "unmerged" / "final")  # an adapter alone
    code, line = export(write_config(work, "unmerged", base_model=str(models["llama"]),
                                     datasets=[{"path": str(work / "alpaca.jsonl"), "type": "alpaca"}]))
    assert code == 2 and "merge it first" in line and "merge-lora" in line

    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = work / "gpt2-run"
    tokenizer = build_tokenizer()
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)).save_pretrained(
        gpt2 / "final")
    tokenizer.save_pretrained(gpt2 / "final")
    config = write_config(work, "gpt2-run", base_model=str(gpt2 / "final"),
                          datasets=[{"path": str(work / "alpaca.jsonl"), "type": "alpaca"}])
    code, line = export(config)
    assert code == 2 and "'gpt2' is not exported" in line and "llama, mistral, qwen2, qwen3" in line and "gpt2" in line
    assert not list(gpt2.glob("*.gguf*"))

    full = trained("mistral-hf-full")
    existing = work / "existing.gguf"
    existing.write_text("mine")
    code, line = export(full, "--output", str(existing))
    assert code == 2 and "already exists" in line and existing.read_text() == "mine"

    code = main(["chat-check", str(write_config(work, "nothing-here", base_model=str(models["llama"]),
                                                datasets=[{"path": str(work / "alpaca.jsonl"), "type": "alpaca"}]))])
    assert code == 2 and "no trained model" in one_line(capsys.readouterr().err)
