"""dataset type alpaca:<style>: the prompt is Axolotl's AlpacaPrompter text for that style
(axolotl/prompters.py, match_prompt_style), and only the output and EOS are trained."""

from __future__ import annotations

import pytest

from tests.trainer.helpers import write_jsonl
from trainer.batch.labels import IGNORE
from trainer.cli import main
from trainer.config import DatasetConfig, parse_config
from trainer.data.formats.prompts import tokenize_row
from trainer.errors import ConfigError

SYS_IN = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.")
SYS = "Below is an instruction that describes a task. Write a response that appropriately completes the request."

# Axolotl's rendering of {instruction: "Add 2 and 3.", input: "", output: "5"} and with input "numbers",
# written out from its format strings (system_format + turn_format, then the output)
EXPECTED = {
    "alpaca:phi": (f"<|system|>\n{SYS}<|end|>\n<|user|>\nAdd 2 and 3.<|end|>\n<|assistant|>\n5",
                   f"<|system|>\n{SYS_IN}<|end|>\n<|user|>\nAdd 2 and 3.<|end|>numbers<|assistant|>5"),
    "alpaca:chatml": (f"<|im_start|>system\n{SYS}<|im_end|>\n<|im_start|>user\nAdd 2 and 3.<|im_end|>\n"
                      "<|im_start|>assistant\n5",
                      f"<|im_start|>system\n{SYS_IN}<|im_end|>\n<|im_start|>user\nAdd 2 and 3.\nnumbers<|im_end|>\n"
                      "<|im_start|>assistant\n5"),
    "alpaca:chat": (f"SYSTEM: {SYS}\nUSER: Add 2 and 3.\nASSISTANT:5",
                    f"SYSTEM: {SYS_IN}\nUSER: Add 2 and 3.\nnumbers\nASSISTANT:5"),
    "alpaca": (f"{SYS}\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:\n5",
               f"{SYS_IN}\n\n### Instruction:\nAdd 2 and 3.\n\n### Input:\nnumbers\n\n### Response:\n5"),
}


class Recorder:
    """The tokenizer sees the rendered text; record it and train on the trailing output + EOS."""
    eos_token = "</s>"

    def __init__(self):
        self.texts = []

    def __call__(self, text, add_special_tokens, return_offsets_mapping):
        self.texts.append(text)
        return {"input_ids": list(range(len(text))), "offset_mapping": [(i, i + 1) for i in range(len(text))]}


@pytest.mark.parametrize("style", list(EXPECTED))
def test_rendered_prompt_is_axolotls(style):
    tokenizer = Recorder()
    ds = DatasetConfig(path="x", type=style)
    for extra, expected in zip(("", "numbers"), EXPECTED[style]):
        row = tokenize_row({"instruction": "Add 2 and 3.", "input": extra, "output": "5"}, ds, tokenizer, False)
        assert tokenizer.texts[-1] == expected + "</s>"
        trained = "".join(tokenizer.texts[-1][i] for i, lab in enumerate(row["labels"]) if lab != IGNORE)
        assert trained == "5</s>"


@pytest.mark.slow
def test_alpaca_phi_trains(make_config, tmp_path):
    rows = [{"instruction": f"Say {i}.", "input": "" if i % 2 else "x", "output": f"number {i}"} for i in range(24)]
    data = write_jsonl(tmp_path / "phi.jsonl", rows)
    assert main(["train", str(make_config(datasets=[{"path": str(data), "type": "alpaca:phi"}], max_steps=2))]) == 0


def test_unknown_style_is_refused():
    with pytest.raises(ConfigError, match="alpaca:instruct\\|chat\\|chatml\\|phi"):
        parse_config({"base_model": "x", "datasets": [{"path": "x", "type": "alpaca:vicuna"}]})


@pytest.mark.slow
def test_axolotl_phi3_ft_example_trains_with_only_model_and_data_swapped(tiny_llama, tmp_path):
    """examples/phi/phi3-ft.yml (copy in data/axolotl_examples): alpaca:phi, early_stopping_patience,
    do_causal_lm_eval with perplexity, eval_table_size, use_reentrant: true, resize_token_embeddings_to_32x."""
    from pathlib import Path

    import yaml

    from tests.trainer.helpers import alpaca_rows, read_metrics, train_losses

    raw = yaml.safe_load((Path(__file__).parents[1] / "fixtures" / "axolotl_examples" / "phi__phi3-ft.yml").read_text())
    data = write_jsonl(tmp_path / "platypus.jsonl", alpaca_rows(100))
    out = tmp_path / "out"
    raw.update(base_model=str(tiny_llama), output_dir=str(out), dataset_prepared_path=str(tmp_path / "prepared"),
               max_steps=3, sequence_len=256)
    raw["datasets"][0]["path"] = str(data)
    config = tmp_path / "phi3-ft.yml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["train", str(config)]) == 0
    assert sorted(train_losses(out)) == [1, 2, 3]
    final_eval = [r for r in read_metrics(out) if "eval_loss" in r][-1]
    assert final_eval["step"] == 3 and final_eval["eval_perplexity"] > 1
    assert (out / "final" / "adapter_model.safetensors").exists()
