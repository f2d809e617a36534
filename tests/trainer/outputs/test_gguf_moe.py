"""export --format gguf for a mixture of experts, read back by transformers' own GGUF loader: a Qwen3-MoE's experts
stacked into llama.cpp's ffn_{gate,up,down}_exps tensors and its router as ffn_gate_inp, with the expert counts in
the header; the model transformers builds from the file computes the checkpoint's logits. (Mixtral, written as
llama.cpp's `llama` with experts, which transformers does not read back: tests/trainer/test_moe_training.py checks
its tensors against the checkpoint's.)"""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from tests.trainer.helpers import run_cli

pytestmark = pytest.mark.slow


def test_a_qwen3_moe_gguf_loads_back_with_the_checkpoint_logits(tmp_path, tiny_qwen3_moe):
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    # transformers' GGUF reader takes no expert width from the file (its qwen3_moe mapping has none) and builds the
    # default, 768, so the stand-in has that width; norm_topk_prob as Qwen3-MoE checkpoints set it and llama.cpp runs
    config = AutoConfig.from_pretrained(tiny_qwen3_moe)
    config.moe_intermediate_size, config.norm_topk_prob = 768, True
    torch.manual_seed(0)
    final = tmp_path / "out" / "final"
    AutoModelForCausalLM.from_config(config).save_pretrained(final)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_qwen3_moe / name, final / name)
    (tmp_path / "rows.jsonl").write_text('{"instruction": "a", "input": "", "output": "b"}\n')
    run = tmp_path / "run.yml"
    run.write_text(yaml.safe_dump({"base_model": str(tiny_qwen3_moe), "learning_rate": 1e-4,
                                   "output_dir": str(tmp_path / "out"),
                                   "datasets": [{"path": str(tmp_path / "rows.jsonl"), "type": "alpaca"}]}))
    result = run_cli("export", str(run), "--format", "gguf", "--outtype", "f32")
    assert result.returncode == 0, result.stderr[-3000:]
    path = tmp_path / "out" / "out-f32.gguf"
    assert f"wrote {path} (qwen3moe, f32" in result.stdout
    reader = gguf.GGUFReader(path)
    assert {k: reader.fields[k].contents() for k in reader.fields if "expert" in k} == {
        "qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 768}
    names = {t.name for t in reader.tensors}
    assert {f"blk.1.{n}.weight" for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp")} <= names
    assert not any(".experts." in n for n in names)
    source = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file=path.name, dtype=torch.float32)
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (back(input_ids=ids).logits - source(input_ids=ids).logits).abs().max() <= 1e-5
