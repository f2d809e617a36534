"""Config validation by the key policy (matrices/axolotl_keys.toml): keys Axolotl would drop are ignored and named,
a near miss of a key the trainer reads gets a "did you mean" warning, refused Axolotl keys say why, every problem is
reported in one run (one line each), no tracebacks."""

from __future__ import annotations

import pytest
import yaml

from tests.trainer.helpers import run_cli
from trainer.cli import main
from trainer.config import parse_config
from trainer.errors import ConfigError

# examples/llama-3/instruct-lora-8b.yml from axolotl-ai-cloud/axolotl, verbatim apart from the model path
AXOLOTL_INSTRUCT_LORA = """\
base_model: {model}
model_type: LlamaForCausalLM
tokenizer_type: AutoTokenizer

load_in_8bit: true
load_in_4bit: false
strict: false

chat_template: llama3
datasets:
  - path: fozziethebeat/alpaca_messages_2k_test
    type: chat_template
    field_messages: messages
    message_field_role: role
    message_field_content: content
    roles:
      user:
        - user
      assistant:
        - assistant

dataset_prepared_path:
val_set_size: 0.05
output_dir: ./outputs/lora-out

sequence_len: 4096
sample_packing: false
pad_to_sequence_len: true

adapter: lora
lora_model_dir:
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_linear: true
lora_fan_in_fan_out:

wandb_project:
wandb_entity:
wandb_watch:
wandb_name:
wandb_log_model:

gradient_accumulation_steps: 4
micro_batch_size: 2
num_epochs: 4
optimizer: adamw_bnb_8bit
lr_scheduler: cosine
learning_rate: 0.0002

train_on_inputs: false
group_by_length: false
bf16: auto
fp16:
tf32: false

gradient_checkpointing: true
early_stopping_patience:
resume_from_checkpoint:
local_rank:
logging_steps: 1
xformers_attention:
flash_attention: true
s2_attention:

warmup_steps: 10
evals_per_epoch: 4
eval_table_size:
eval_max_new_tokens: 128
saves_per_epoch: 1
debug:
deepspeed:
weight_decay: 0.0
fsdp:
fsdp_config:
special_tokens:
   pad_token: <|end_of_text|>
"""

BASE = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}]}


def test_unknown_key_is_ignored_and_a_near_miss_of_a_key_the_config_sets_is_a_warning():
    cfg, notes = parse_config({**BASE, "learning_rate": 3e-4, "lerning_rate": 1e-4, "push_to_hub": True, "data_seed": 7})
    assert cfg.learning_rate == 3e-4  # the key it resembles is set: the near miss is ignored, as Axolotl drops it ...
    assert "warning: 'lerning_rate' is not a key (ignored); did you mean 'learning_rate'?" in notes  # ... but said
    # keys in no Axolotl release: one warning line, the first note (data_seed has a row of its own: inert)
    assert notes[0] == "warning: ignored: push_to_hub (not Axolotl keys: Axolotl drops them too)"


@pytest.mark.parametrize("typo", ["lerning_rate", "lr"])
def test_a_near_miss_of_a_key_the_config_does_not_set_is_an_error(typo):
    # ignoring it would train at the default learning rate instead of the value written
    with pytest.raises(ConfigError, match=rf"'{typo}' is not a key; did you mean 'learning_rate'\? \(the config does "
                                          r"not set learning_rate"):
        parse_config({**BASE, typo: 1e-4})


def test_a_near_miss_is_an_error_exactly_where_the_key_it_resembles_changes_what_is_trained():
    """The resume table (trainer/config/resume.py) says which keys change what is trained, and keys.LENGTH how long it
    trains: a near miss of one of those is an error (its default would be trained instead), of any other a warning (a
    real user's `saves_total_limit` keeps checkpoints differently, trains the same; Axolotl drops it silently)."""
    from trainer.config import keys, resume

    fields = set(resume.CLASSES)
    for key in sorted(fields - {"resume_from_checkpoint", "auto_resume_from_checkpoints"}):
        typo = key[:-1] + ("x" if key[-1] != "x" else "y")
        if any(keys.one_edit(typo, other) for other in fields - {key}) or typo in fields:
            continue  # the typo is one edit from two keys: not this test's case
        try:
            _, notes = parse_config({**BASE, typo: 1})
        except ConfigError as err:
            assert resume.CLASSES[key] == resume.TRAINS or key in keys.LENGTH, (key, str(err))
            assert f"did you mean '{key}'" in str(err)
        else:
            assert resume.CLASSES[key] != resume.TRAINS and key not in keys.LENGTH or key in BASE, key
            assert any(f"did you mean '{key}'" in n for n in notes), (key, notes)


def test_unknown_key_inside_a_dataset_entry():
    with pytest.raises(ConfigError, match="'datasets.0.feild_instruction' is not a key; did you mean "
                                          "'datasets.0.field_instruction'"):
        parse_config({**BASE, "datasets": [{"path": "x/y", "type": "alpaca", "feild_instruction": "q"}]})


def test_refused_axolotl_key_says_why_and_what_to_write():
    with pytest.raises(ConfigError, match=r"sage_attention: SageAttention is a quantized attention kernel .* "
                                          r"remove it to train that way"):
        parse_config({**BASE, "sage_attention": True})


def test_empty_refused_keys_and_inert_keys_are_accepted():
    cfg, notes = parse_config({**BASE, "sage_attention": None, "fsdp": None, "strict": True})
    assert cfg.base_model == "org/model"
    assert any(n.startswith("ignored: strict") for n in notes)  # one note line naming the inert keys
    assert not any("sage_attention" in n for n in notes)  # empty: asks for nothing


def test_null_means_default():
    cfg, _ = parse_config({**BASE, "fp16": None, "micro_batch_size": None, "bf16": "auto"})
    assert cfg.micro_batch_size == 1 and cfg.fp16 is None


def test_bad_values_are_reported_with_their_key():
    with pytest.raises(ConfigError, match=r"lr_scheduler: got 'cosine_with_restart'"):
        parse_config({**BASE, "lr_scheduler": "cosine_with_restart"})
    with pytest.raises(ConfigError, match="micro_batch_size"):
        parse_config({**BASE, "micro_batch_size": 0})
    with pytest.raises(ConfigError, match="warmup_steps: 3 beside warmup_ratio: 0.1: set one"):
        parse_config({**BASE, "warmup_ratio": 0.1, "warmup_steps": 3})
    with pytest.raises(ConfigError, match="unknown template 'llama_3'; did you mean 'llama3'"):
        parse_config({**BASE, "chat_template": "llama_3"})
    with pytest.raises(ConfigError, match="optimizer: unknown optimizer 'adamw_bnb_9bit'; did you mean 'adamw_bnb_8bit'"):
        parse_config({**BASE, "optimizer": "adamw_bnb_9bit"})


def test_legacy_attention_flags_mean_attn_implementation():
    assert parse_config({**BASE, "flash_attention": True})[0].requested_attention == "flash_attention_2"
    assert parse_config({**BASE, "sdp_attention": True})[0].requested_attention == "sdpa"
    with pytest.raises(ConfigError, match="choose one attention"):
        parse_config({**BASE, "flash_attention": True, "attn_implementation": "eager"})


@pytest.mark.slow
def test_bad_config_fails_with_one_clear_line(tmp_path, tiny_llama):
    raw = yaml.safe_load(AXOLOTL_INSTRUCT_LORA.format(model=tiny_llama))
    raw.update(chat_template="llama_3", optimizer="adamw_bnb_9bit", sage_attention=True)
    path = tmp_path / "bad.yml"
    path.write_text(yaml.safe_dump(raw))
    result = run_cli("validate", str(path), "--gpu", "a100")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    # every problem in one run, one line each, so one run shows all that must change
    assert len(lines) == 3, lines
    assert all(line.startswith("error: ") for line in lines)
    assert any(line.startswith("error: sage_attention: SageAttention") for line in lines)
    assert any("unknown template 'llama_3'" in line for line in lines)
    assert any("unknown optimizer 'adamw_bnb_9bit'" in line for line in lines)


def test_real_axolotl_config_validates_unchanged(tmp_path, tiny_llama, capsys):
    raw = yaml.safe_load(AXOLOTL_INSTRUCT_LORA.format(model=tiny_llama))
    raw["datasets"][0]["path"] = str(tmp_path / "messages.jsonl")
    (tmp_path / "messages.jsonl").write_text('{"messages": []}\n')
    path = tmp_path / "fixed.yml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(path), "--gpu", "t4"]) == 0
    out = capsys.readouterr().out
    assert "flash_attention_2 -> sdpa" in out  # flash_attention: true on a T4
    assert "bf16: auto -> fp16" in out
    assert "ignored: model_type (" in out and "; tokenizer_type (AutoTokenizer picks the class" in out  # each with its reason
    assert "load_in_8bit: bitsandbytes LLM.int8()" in out and "adapter:    lora on 8-bit" in out
    assert "optimizer:  adamw_bnb_8bit (bitsandbytes)" in out


@pytest.mark.slow
def test_missing_dataset_file_is_bad_input(make_config, tmp_path):
    path = make_config(datasets=[{"path": str(tmp_path / "nope.jsonl"), "type": "alpaca"}])
    result = run_cli("validate", str(path), "--gpu", "cpu")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: datasets.0.path: file not found: {tmp_path / 'nope.jsonl'}"


def test_missing_config_and_bad_yaml(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "none.yml")]) == 2
    bad = tmp_path / "bad.yml"
    bad.write_text("base_model: [unclosed\n")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "config file not found" in err and f"{bad} line 1 column 13: a [list] opens here and is not closed" in err


@pytest.mark.slow
def test_debug_shows_the_traceback(tmp_path):
    result = run_cli("--debug", "validate", str(tmp_path / "none.yml"))
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == "trainer 0.1.0"


def test_validate_reports_key_file_and_hardware_problems_in_one_run(make_config, tmp_path, capsys):
    """A user fixes everything in one round: a refused key, a bad value, a missing file and the GPU's limit."""
    path = make_config(sage_attention=True, optimizer="adamw_bnb_9bit", bf16=True,
                       datasets=[{"path": str(tmp_path / "nope.jsonl"), "type": "alpaca"}])
    assert main(["validate", str(path), "--gpu", "t4"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("error: ") for line in lines), lines
    assert [line.split(":")[1].strip() for line in lines] == ["sage_attention", "optimizer", "datasets.0.path", "bf16"]


def test_a_config_file_without_learning_rate_is_refused_as_axolotl_refuses_it(tmp_path):
    from trainer.config import load_config

    path = tmp_path / "no-lr.yml"
    path.write_text(yaml.safe_dump({**BASE, "micro_batch_size": 1}))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.problems == [("config", f"{path}: learning_rate: missing (Axolotl requires it; this trainer "
                                             "does not guess a value for it)")]


@pytest.mark.slow
def test_lr_for_learning_rate_is_one_line_naming_the_file_and_exit_2(make_config):
    from tests.trainer.helpers import run_cli

    config = make_config(learning_rate=None, lr=2e-4)
    result = run_cli("validate", str(config), "--gpu", "cpu")
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip() == (f"error: {config}: 'lr' is not a key; did you mean 'learning_rate'? (the config "
                                     "does not set learning_rate: ignoring lr would train with its default)")


@pytest.mark.parametrize("overrides, line", [
    ({"learning_rate": None, "lerning_rate": 2e-4},
     "'lerning_rate' is not a key; did you mean 'learning_rate'? (the config does not set learning_rate: ignoring "
     "lerning_rate would train with its default)"),
    ({"learning_rate": None}, "learning_rate: missing (Axolotl requires it; this trainer does not guess a value for it)"),
])
def test_validate_refuses_a_near_miss_or_a_missing_required_key_in_one_line(make_config, capsys, overrides, line):
    """`python -m trainer validate` (its function, in process): exit 2 and one line naming the file and the key."""
    path = make_config(**overrides)
    assert main(["validate", str(path), "--gpu", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {path}: {line}"


@pytest.mark.parametrize("key", ["datasets", "test_datasets"])
def test_a_dataset_list_written_as_one_mapping_is_one_line_saying_so(key):
    """A user's config whose first `- path:` line is commented out leaves `datasets:` one mapping (Axolotl fails on it
    with "dictionary update sequence element #0 has length 1"): one line naming the key and the likely cause."""
    raw = {"base_model": "org/model", "learning_rate": 2e-4, "datasets": [{"path": "org/data", "type": "alpaca"}],
           key: {"type": "chat_template", "data_files": "rows.json"}}
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert [p for p in err.value.problems] == [
        ("config", f"{key}: must be a list of dataset entries, each starting with `- ` (`- path: ...`), but is one "
                   "mapping (type, data_files): is the `- ` of its first line missing or commented out?")]
