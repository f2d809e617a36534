"""Axolotl's own validation as the oracle: wherever Axolotl accepts a config, envtool's reader accepts it too, or
refuses it for a reason of a documented class.

The oracle is Axolotl's `validate_config` (scripts/axolotl_oracle.py, in the environment .ci/setup builds under
.ci-cache/axolotl-oracle: the `axolotl` wheel from PyPI, --no-deps, over the .venv's own torch/transformers/pydantic),
run once per session in one subprocess over every config, batched. envtool's side is trainer.setup.start (what
`python -m trainer validate` calls) for an H100, in this process.

The configs: every user config of tests/trainer/fixtures/user_configs, every example of
tests/trainer/fixtures/axolotl_examples, and GENERATED configs: a small valid base plus 1-4 keys drawn (hypothesis) from
AxolotlInputConfig's own fields with values of each field's type (bools, literals/enums, small ints and floats, short
strings), and from matrices/axolotl_keys.toml's rows.

A refusal by envtool of a config Axolotl accepts is allowed only where every problem it names is about a key one of
the tables below names, each with why: LIMITS (hardware, or code the user wrote for Axolotl's internals), STRICTER
(only to prevent a silent difference or a late failure) and GAPS (what Axolotl trains and this trainer does not yet:
the work left); keys Axolotl's own schema refuses are named in AXOLOTL_REFUSES (refused on both sides, no
disagreement); or where its kind is file (a local file the config names that is not on this machine). Nothing is
excused by the refusal's wording. Everything else fails the test with the config and both verdicts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

import pytest
from tests.support import oracle
import yaml

ROOT = Path(__file__).resolve().parents[3]
ORACLE = ROOT / ".ci-cache" / "axolotl-oracle"
FIXTURES = ROOT / "tests" / "trainer" / "fixtures"
N_GENERATED = int(os.environ.get("ORACLE_N", 2000))

# Where envtool refuses a config Axolotl accepts, every problem line must name a key (`_key`: the first key the line
# names, `datasets.0.x` read as `datasets[].x`; a near miss's own name) that one of the tables below names, with why.
# Nothing is excused by what the refusal says. Besides the tables only the kind `file` is excused (a local file the
# config names that is not on this machine: the same config refused by Axolotl there).

# LIMITS: refused for one of the two stated limits, "hardware" (the GPU lacks what the kernel needs, its floor named)
# or "user code" (code the user wrote for Axolotl's internals). matrices/axolotl_keys.toml says `refused` only for
# these and the GAPS below.
LIMITS: dict[str, tuple[str, str]] = {
    "trainer_cls": ("user code", "a trainer class of the user's own, subclassing Axolotl's trainers; this trainer has "
                                 "one loop and no Trainer to subclass"),
    "plugins": ("user code", "a plugin module of the user's own (not an axolotl.integrations plugin): its hooks are "
                             "written against Axolotl's plugin manager and trainer"),
}

# STRICTER: refused where Axolotl's schema takes the value, only to prevent a silent difference or a late failure:
# each with why (Axolotl's source says what it does instead).
STRICTER: dict[str, str] = {
    "experts_implementation": "a value transformers' ExpertsInterface does not know (or ''): Axolotl's "
                              "set_experts_implementation raises ValueError when the model loads; refused here first",
    "logging_steps": "0: transformers refuses logging_steps 0 with the steps strategy Axolotl sets (fails at start)",
    "torch_empty_cache_steps": "0: transformers' TrainingArguments refuses it (must be a positive int)",
    "dataset_processes": "0: datasets' map refuses num_proc 0 (fails while preprocessing)",
    "lora_alpha": "0: LoRA's scale alpha/r is 0, the adapter adds nothing: trains nothing without a word",
    "rl_beta": "0: DPO's loss is constant in the policy at beta 0: trains nothing",
    "orpo_alpha": "0 with rl: dpo/ipo/kto/simpo and no rl_beta: Axolotl passes it as the method's beta, whose loss is "
                  "then constant in the policy: trains nothing (with rl: orpo, 0 trains the chosen answers' NLL, as "
                  "there)",
    "dpo_beta": "0: as rl_beta (its older name)",
    "dpo_label_smoothing": ">= 0.5 inverts which answer cDPO prefers: trains the opposite preference",
    "loss_watchdog_threshold": "0: every loss is above it, Axolotl's watchdog stops the run after its patience",
    "image_size": "0: a resize to 0 pixels; fails in the image processor",
    "fsdp_version": "a version that names no FSDP (only 1 and 2 exist); Axolotl passes it to accelerate",
    "wandb_mode": "a mode wandb does not have (online, offline, disabled): wandb.init refuses it",
    "cls_model_config": "a name that is no transformers config class: Axolotl's getattr fails when loading",
    "processor_type": "a name that is no transformers processor class: Axolotl's getattr fails when loading",
    "ray_run_name": "an empty or path-like run name: the run's folder would be the storage path itself",
    "batch_size": "not a whole number of micro-batches: Axolotl's integer division trains another batch size",
    "min_sample_len": "under rl: Axolotl's preference loaders never read it (dropped without a word)",
    "center_rewards_coefficient": "without reward_model: Axolotl's causal trainer never reads it (dropped silently)",
    "num_labels": "without reward_model/process_reward_model: Axolotl never reads it (dropped silently)",
    "process_reward_model": "with rl set: Axolotl builds the rl trainer and drops process_reward_model silently",
    "lora_model_dir": "without adapter: Axolotl loads no adapter and drops it silently",
    "load_best_model_at_end": "without save_steps/eval_steps dividing them: transformers refuses it at start",
    "max_packed_sequence_len": "beside sequence_len: two values for one length, Axolotl keeps one silently",
    "dataset_num_proc": "beside dataset_processes: two values for one count, Axolotl keeps one silently",
    "noisy_embedding_alpha": "beside neftune_noise_alpha: two values for one noise, Axolotl keeps one silently",
    "rl": "gdpo without trl.reward_funcs: TRL's GDPO trainer fails without reward functions",
    "model_quantization_config": "Mxfp4Config without dequantize: transformers cannot train MXFP4 weights "
                                 "(Mxfp4HfQuantizer.is_trainable is False), fails when training starts",
    "datasets[].type": "with rl: grpo, a type with no transform function: Axolotl's RL loader applies the DPO "
                       "transform of that name, which reads chosen/rejected columns (KeyError while preprocessing)",
    "datasets[].type.format": "a format naming a placeholder it is not filled with: Axolotl's str.format fails "
                              "with KeyError while preprocessing",
    "dataset_shard_num": "one of dataset_shard_num / dataset_shard_idx alone, or with rl: or a stream: Axolotl "
                         "shards only SFT rows with both (utils/data/sft.py) and drops the rest without a word",
    "dataset_shard_idx": "an index past the shards: datasets' shard() raises IndexError while preparing",
    "loraplus_lr_ratio": "0: LoRA+ trains lora_B at learning_rate x 0, and B starts at 0: the adapter trains nothing; "
                         "beside embedding_lr / embedding_lr_scale / lr_groups: Axolotl's LoRA+ optimizer drops them "
                         "without a word",
    "lora_r": "0: peft refuses a rank of 0 when the adapter is built",
    "lora_dropout": "1: the adapter's input is always dropped: trains nothing",
    "lr_scheduler": "a name transformers' SchedulerType does not have ('auto', ...): refused when training starts",
    "dp_shard_size": "above 1 without FSDP (fsdp_version: 2 and fsdp_config): Axolotl's _get_parallel_config_kwargs "
                     "raises on several GPUs and, on one, shards nothing without a word",
    "lisa_n_layers": "one of lisa_n_layers / lisa_step_interval without the other: Axolotl trains LISA only with "
                     "both (`if lisa_step_interval and lisa_n_layers`) and drops the one given without a word",
    "lisa_step_interval": "as lisa_n_layers (they go together)",
    "tiled_mlp_num_shards": "0: Axolotl's tiled MLP splits the sequence into 0 shards (torch.chunk refuses 0 chunks "
                            "in the first forward)",
    "streaming_multipack_buffer_size": "0: Axolotl's streaming.py passes it as datasets' shuffle buffer (0: no "
                                       "shuffle) and as the packing map's batch_size (0: the whole stream at once)",
    "pretrain_multipack_buffer_size": "0: as streaming_multipack_buffer_size (its deprecated name)",
    "eaft_k": "0 or 1: EAFT's entropy over the top-k logits is 0, every token's weight 0: trains nothing",
    "warmup_ratio": "1 with lr_scheduler: one_cycle: the annealing phase is 0 steps, torch's OneCycleLR divides by "
                    "zero at the first step (Axolotl's create_scheduler too)",
    "warmup_steps": "0 beside a warmup_ratio: Axolotl reads warmup_steps first, trains with no warmup and drops the "
                    "ratio without a word",
    "use_pose": "with sample_packing and without pose_max_context_len: Axolotl's add_pose_position_ids subtracts "
                "the row's length from None (TypeError while preprocessing)",
    "pose_max_context_len": "below sequence_len: a longer row draws from random.randint(0, a negative number), "
                            "which fails while preprocessing in Axolotl",
    "pose_num_chunks": "0: Axolotl divides the row's length by it (ZeroDivisionError while preprocessing)",
    "trl.sync_ref_model": "with an adapter (TRL's GRPOTrainer raises NotImplementedError at its start: the reference "
                          "is the base with the adapter disabled, no model to sync) or with trl.beta 0 (TRL raises "
                          "ValueError: no reference model at all)",
    "trl.ref_model_mixup_alpha": "0 with sync_ref_model: Axolotl passes only a non-zero alpha (`if "
                                 "trl.ref_model_mixup_alpha:`), so TRL mixes with its own 0.6 without a word",
    "trl.ref_model_sync_steps": "below 1 with sync_ref_model: Axolotl passes 0 on as nothing (TRL syncs every 512 "
                                "steps instead) and a negative count as it is (TRL syncs every |n| steps)",
    "lr_scheduler_type": "transformers' name of lr_scheduler, which Axolotl's schema drops while lr_scheduler is "
                         "unset: Axolotl trains with the default schedule",
}

# GAPS: what Axolotl trains and this trainer does not yet (issue 42): refused here, named so that the list is the
# work left. A key leaves this table when it is honoured (test_refused_keys_are_named_here keeps the table and
# matrices/axolotl_keys.toml's refused rows together).
_NOT_YET = "Axolotl trains it; not implemented here yet"
# AXOLOTL_REFUSES: keys Axolotl 0.19's own schema refuses (its validators raise on any value): refused here too, so no
# disagreement; the matrix says refused with that reason
AXOLOTL_REFUSES: dict[str, str] = {
    "rpo_alpha": "utils/schemas/deprecated.py: deprecated in TRL >= 0.29 (it needs several loss types)",
    "dpo_norm_loss": "utils/schemas/deprecated.py: no longer supported after TRL 0.29's changes",
    "s2_attention": "utils/schemas/deprecated.py: shifted-sparse attention is no longer supported",
}

GAPS: dict[str, str] = {
    "trl.rollout_func": f"GRPO option: {_NOT_YET}",
    **dict.fromkeys(("trl.replay_buffer_size", "trl.replay_recompute_logps", "trl.reroll_max_groups",
                     "trl.reroll_start_fraction", "trl.skip_zero_advantage_batches"),
                    f"with async_prefetch / use_data_producer (Axolotl's fast asynchronous GRPO trainer): {_NOT_YET}"),
    **dict.fromkeys(("dsv4_fp4_grouped_mode", "dsv4_fp8_lora_kernel", "dsv4_fp8_nonexpert_mode",
                     "gemma4_fp8_nonexpert", "gemma4_nf4_nonexpert", "nonexpert_quantization", "quantize_moe_experts",
                     "nvfp4_merge_aware", "nvfp4_merge_aware_start_step"),
                    f"low-precision (fp8/fp4/nf4) storage or kernels of MoE models: {_NOT_YET} (kernels with a GPU "
                    "floor belong in LIMITS once implemented)"),
    "fp8": "float8 training (torchao's float8 linears) on a GPU that has float8 tensor cores: the refusal's kind is "
           "`hardware` but the H100 has them; not implemented here yet",
    "sage_attention": f"SageAttention kernels (sm_80 to sm_120, no CPU kernel; they run on an H100, so not a "
                      f"hardware limit there): {_NOT_YET}",
    "liger_use_token_scaling": f"Liger's token-scaled loss with context_parallel_size > 1: {_NOT_YET}",
    "expert_parallel_token_capacity": f"DeepEP's per-expert token cap, which drops the routes past it (the "
                                      f"all-to-all here drops none): {_NOT_YET}",
    "gptq": "GPTQ checkpoints: gptqmodel does not install beside the tested torch stack (a dependency conflict)",
    "eval_causal_lm_metrics": "comet listed with do_causal_lm_eval: it needs the unbabel-comet package and the "
                              "Unbabel/wmt22-comet-da model from the Hub (sacrebleu, ter, chrf and perplexity are "
                              "computed; unset, the default list less comet, with a note)",
    "lora_target_parameters": "one string (not a list): Axolotl passes it to peft as given; refused here",
}
# keys the table says are read (honoured) whose some values a rule refuses: named above for those values
_REFUSED_BY_A_RULE = ("plugins", "fp8", "eval_causal_lm_metrics", "lora_target_parameters",
                      "quantize_moe_experts", "liger_use_token_scaling",
                      "trl.replay_buffer_size", "trl.replay_recompute_logps", "trl.reroll_max_groups",
                      "trl.reroll_start_fraction", "trl.skip_zero_advantage_batches")  # (honoured; some values refused)


def _oracle(kind: str, payload=None):
    env = {**os.environ, "PYTHONPATH": str(ORACLE), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "axolotl_oracle.py"), kind], env=env,
                         input=json.dumps(payload) if payload is not None else "", capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _generated(fields: dict, n: int) -> list[dict]:
    """n configs: a valid base plus 1-4 keys of Axolotl's schema, drawn by hypothesis (derandomized: the same
    configs every run)."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    rows = tomllib.loads((ROOT / "matrices" / "axolotl_keys.toml").read_text())
    table = {r["name"] for r in rows.get("key", []) if re.fullmatch(r"\w+", r["name"]) and r["name"] in fields}
    names = sorted(k for k, v in fields.items() if v["kind"] != "other" and k not in BASE) + sorted(table - set(BASE))

    def values(name: str):
        f = fields.get(name, {"kind": "other"})
        return {"bool": st.booleans(), "int": st.integers(min_value=0, max_value=4096),
                "float": st.floats(min_value=0, max_value=1, allow_nan=False),
                "str": st.sampled_from(["", "auto", "none", "default", "linear", "cosine"]),
                "choice": st.sampled_from(f.get("choices") or [None]),
                }.get(f["kind"], st.sampled_from([True, False, 1, "auto"]))

    extra = st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: values(k) for k in keys}))
    drawn: list[dict] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(extra)
    def draw(keys):
        drawn.append({**BASE, **keys})

    draw()
    return drawn


BASE = {"base_model": "NousResearch/Llama-3.2-1B", "datasets": [{"path": "tatsu-lab/alpaca", "type": "alpaca"}],
        "sequence_len": 512, "micro_batch_size": 1, "gradient_accumulation_steps": 1, "num_epochs": 1,
        "learning_rate": 2e-4, "optimizer": "adamw_torch", "output_dir": "./out"}


def _envtool(path: Path) -> tuple[str, list[str]]:
    """('ok' | 'refused' | 'crash', the problem lines with their kinds) for `validate --gpu h100` of `path`."""
    from trainer.errors import TrainerError
    from trainer.setup import start

    try:
        start(path, "h100")
    except TrainerError as err:
        return "refused", [f"{k}: {p}" for k, p in (err.problems or [("config", str(err))])]
    except Exception as err:  # noqa: BLE001
        return "crash", [f"{type(err).__name__}: {err}"]
    return "ok", []


def _key(line: str) -> str:
    """The key a problem line names: the name a near miss quotes, else the first key (a row of
    matrices/axolotl_keys.toml) in the words before its first ':', `datasets.0.field_tools` read as
    `datasets[].field_tools`; else those words."""
    from trainer.config import keys

    near = re.search(r"'([^']+)' is not a key", line)
    head = re.sub(r"\.\d+(?=\.|$)", "[]", near.group(1) if near else line.split(":", 1)[0].strip())
    return next((w for w in re.findall(r"[A-Za-z_][\w.\[\]]*", head) if keys.decision(w)), head)


def _explained(problem: str) -> str | None:
    kind, _, line = problem.partition(": ")
    if kind == "file":
        return kind
    key = _key(line)
    if key in LIMITS:
        return LIMITS[key][0]
    return "stricter" if key in STRICTER else "gap (issue 42)" if key in GAPS else None


def test_refused_keys_are_named_here():
    """matrices/axolotl_keys.toml's refused rows and the tables agree: a refused key is a stated limit, a named
    gap or one Axolotl refuses too, and a key named as a limit or gap is refused (or no longer in the table: honoured, and its row goes)."""
    rows = tomllib.loads((ROOT / "matrices" / "axolotl_keys.toml").read_text())["key"]
    refused = {r["name"] for r in rows if r.get("decision") == "refused"}
    decided = {r["name"]: r.get("decision") for r in rows}
    assert sorted(refused - set(LIMITS) - set(GAPS) - set(AXOLOTL_REFUSES)) == []
    assert sorted(k for k in {**LIMITS, **GAPS} if decided.get(k) not in ("refused", None)
                  and k not in _REFUSED_BY_A_RULE) == []
    assert all(kind in ("hardware", "user code") for kind, _ in LIMITS.values())


@pytest.mark.slow
def test_where_axolotl_accepts_a_config_envtool_does_or_says_why(tmp_path, monkeypatch):
    oracle.require(ORACLE / "axolotl", ORACLE)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    configs: list[tuple[str, dict, Path]] = []
    for group in ("user_configs", "axolotl_examples"):
        for p in sorted((FIXTURES / group).rglob("*.y*ml")):
            raw = yaml.safe_load(p.read_text())
            if isinstance(raw, dict):
                configs.append((f"{group}/{p.relative_to(FIXTURES / group)}", raw, p))
    fields = _oracle("schema")
    for i, raw in enumerate(_generated(fields, N_GENERATED)):
        p = tmp_path / f"gen{i}.yml"
        p.write_text(yaml.safe_dump(raw))
        configs.append((f"generated/{i}", raw, p))
    verdicts = _oracle("verdicts", [raw for _, raw, _ in configs])
    counts, causes, unexplained = Counter(), Counter(), []
    for (name, raw, path), axo in zip(configs, verdicts):
        group = name.split("/")[0]
        if not axo["ok"]:
            counts[f"{group}: axolotl refuses"] += 1
            continue
        verdict, problems = _envtool(path)
        if verdict == "ok":
            counts[f"{group}: agree"] += 1
            continue
        why = [_explained(p) for p in problems]
        if verdict == "refused" and all(why):
            counts[f"{group}: explained"] += 1
            causes.update(set(why))
            continue
        counts[f"{group}: DISAGREE"] += 1
        unexplained.append((name, [p for p, w in zip(problems, why) if not w],
                            {k: v for k, v in raw.items() if k not in BASE} if group == "generated" else None))
    print(json.dumps({"counts": dict(sorted(counts.items())), "causes": dict(causes)}, indent=1))
    for u in unexplained:
        print("UNEXPLAINED", u)
    by_key = Counter(_key(p.partition(": ")[2]) for _, ps, _ in unexplained for p in ps)
    print("UNEXPLAINED KEYS", json.dumps(dict(by_key.most_common()), indent=1))
    assert sum(1 for n, _, _ in configs if n.startswith("generated/")) >= N_GENERATED
    assert not unexplained, f"{len(unexplained)} configs Axolotl accepts are refused for no documented reason"
