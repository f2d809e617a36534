"""One copy of the facts: every plan `envtool resolve` makes, fed to the trainer's adaptation, gives an
attention backend transformers has, on hardware that runs it (the trainer reads the same matrices/)."""

import pytest
from transformers.integrations.hub_kernels import is_kernel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from matrices import catalog
from resolver import hardware as resolver_hardware
from resolver import matrix as matrix_module
from resolver.pipeline import target_platform
from resolver.errors import Unsatisfiable
from resolver.solve import Request, solve
from trainer import facts
from trainer.config import parse_config
from trainer.runtime.hardware import adapt, attention_backend, gpu_from_name, gpu_from_plan

M = matrix_module.load()
TRANSFORMERS_BACKENDS = set(ALL_ATTENTION_FUNCTIONS) | {"eager"}
CONFIG = {"base_model": "tiny", "datasets": [{"path": "d.jsonl", "type": "completion"}]}
ATTENTIONS = [None] + [b.name for b in M.attention]


@pytest.mark.parametrize("gpu", [g.name for g in M.gpus] + ["cpu"])
def test_every_catalog_plan_reaches_transformers_as_a_backend_it_has_on_hardware_that_runs_it(gpu):
    cfg, _ = parse_config(CONFIG)
    spec = resolver_hardware.lookup(gpu, M)
    row = next((g for g in M.gpus if g.name == gpu), None)
    platform = "x86_64" if row is None or "x86_64" in row.platforms else row.platforms[0]  # GH200: aarch64 hosts
    if row is not None and row.l4t:  # a Jetson on L4T: refused before solving, with its note (no wheel runs there)
        with pytest.raises(Unsatisfiable, match="L4T"):
            target_platform(spec, None, None, M)
        return
    for attention in ATTENTIONS:
        try:
            plan = solve(Request(gpu=spec, driver=None, python="3.11", attention=attention, target=gpu,
                                 platform=platform), M)
        except Unsatisfiable as err:
            assert attention is not None, f"{gpu}: no plan at all: {err}"
            continue  # the resolver refuses what the hardware cannot run, with a reason
        runtime = adapt(cfg, gpu_from_plan(plan.to_dict(), "plan"), plan.to_dict())
        # a backend transformers has, or a Hub kernel id it loads through `kernels` (attention.toml names both)
        assert runtime.attention in TRANSFORMERS_BACKENDS or is_kernel(runtime.attention), (gpu, attention, runtime)
        backend = next(b for b in facts.rows("attention", "backend") if b["transformers"] == runtime.attention)
        assert catalog.backend_runs_on(backend, spec.compute_capability), (gpu, attention, runtime)
        if attention is None or plan.attention == attention:
            assert attention_backend(plan.attention)["transformers"] == runtime.attention, (gpu, attention)


@pytest.mark.parametrize("name", ["b200", "rtx5090", "b300", "h800", "NVIDIA H100 80GB HBM3", "Tesla T4",
                                  "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090"])
def test_the_trainer_knows_every_gpu_the_resolver_knows(name):
    gpu = gpu_from_name(name)
    assert gpu.compute_capability == resolver_hardware.lookup(name, M).compute_capability
    assert gpu.arch == M.arch_for(gpu.compute_capability).name


def test_flash_attention_3_is_not_kept_on_blackwell():
    cfg, _ = parse_config({**CONFIG, "attn_implementation": "flash_attention_3"})
    runtime = adapt(cfg, gpu_from_name("b200"))
    assert runtime.attention == "flash_attention_2"
    assert "flash_attention_3 needs sm_90 only" in " ".join(runtime.changes)


def test_a_plan_that_asks_for_xformers_trains_with_sdpa_and_says_why():
    plan = solve(Request(gpu=resolver_hardware.lookup("t4", M), driver=None, python="3.11", attention="xformers"),
                 M).to_dict()
    cfg, _ = parse_config(CONFIG)
    runtime = adapt(cfg, gpu_from_plan(plan, "plan"), plan)
    assert runtime.attention == "sdpa"
    assert "transformers has no xformers backend" in " ".join(runtime.changes)
