"""Which experts forward a mixture-of-experts model runs: transformers' own (eager, batched_mm, grouped_mm: plain
torch, every device) or a fused kernel, decided once from the config and the GPU by `choose`.

The keys that ask for a kernel, as Axolotl reads them: `experts_implementation: sonicmoe | scattermoe | deepgemm`,
and its kernels plugin's `use_sonicmoe` / `use_scattermoe` / `expert_backend` (src/axolotl/integrations/kernels/
args.py at 067b021: expert_backend sets the flag, the flag sets experts_implementation).

- SonicMoE runs through transformers' own integration (transformers 5.23 integrations/sonicmoe.py: registered as
  "sonicmoe" in its ExpertsInterface; `is_sonicmoe_loadable` asks for the `kernels` package, a CUDA GPU of compute
  capability 9.0 or newer, nvidia-cutlass-dsl >= 4.6.0 and apache-tvm-ffi >= 0.1.10; the kernel itself,
  kernels-community/sonic-moe, is fetched by `kernels` from the Hugging Face Hub at its first load). A plan for a
  CUDA GPU at sm_90+ installs those packages (trainer/features.py `_sonicmoe`, matrices/packages.toml); the
  trainer loads the kernel before training starts, so a kernel that cannot load (no build for this torch/CUDA, no
  Hub) is one note and grouped_mm, never a failure at the first step.
- ScatterMoE is Axolotl's own triton code (src/axolotl/integrations/kernels/libs/scattermoe_lora), published in no
  package (PyPI has no `scattermoe` project, read 2026-12-08): grouped_mm runs, with a note.
- DeepGEMM (transformers' "deepgemm") JIT-compiles with a system CUDA toolkit's nvcc (is_deepgemm_loadable), which
  no plan installs: grouped_mm runs, with a note.

Every kernel computes the experts' same matmuls as grouped_mm (a speed option: the numbers differ by rounding
only), so a note and grouped_mm is what a GPU that cannot run the kernel gets, never a refusal.
"""

from __future__ import annotations

from typing import NamedTuple

from trainer.config.model import RUN_HERE  # transformers' plain-torch experts forwards: every device

FALLBACK = "grouped_mm"  # transformers' default experts forward for MoE models
SONICMOE_FLOOR = (9, 0)  # transformers 5.23 integrations/sonicmoe.py is_sonicmoe_loadable: major >= 9
NOT_PACKAGED = {
    "scattermoe": "Axolotl's own triton kernels (its kernels plugin, libs/scattermoe_lora), which no package "
                  "publishes (PyPI has no scattermoe project, read 2026-12-08)",
    "deepgemm": "DeepGEMM's kernels, which JIT-compile with a system CUDA toolkit's nvcc (transformers' "
                "is_deepgemm_loadable) that no plan installs",
}


class Choice(NamedTuple):
    asked: str | None  # the kernel the config asks for ("sonicmoe", ...), or a plain-torch forward, or None
    runs: str | None  # what the model is set to: an ExpertsInterface name; None leaves transformers' default
    note: str | None  # what the run says about it (None when it runs as asked)


def asked(cfg) -> tuple[str | None, str]:
    """The experts forward the config asks for, and the key that asks (as a user reads it)."""
    if cfg.experts_implementation:
        return cfg.experts_implementation, f"experts_implementation: {cfg.experts_implementation}"
    if cfg.expert_backend in ("sonicmoe", "scattermoe"):
        return cfg.expert_backend, f"expert_backend: {cfg.expert_backend}"
    for name in ("sonicmoe", "scattermoe"):
        if getattr(cfg, f"use_{name}") is True:
            return name, f"use_{name}: true"
    return None, ""


def sonicmoe_runs_on(gpu) -> str | None:
    """None where SonicMoE's floor admits this GPU (a CUDA GPU at sm_90+), else why not."""
    if gpu.kind != "nvidia":
        return f"it runs on NVIDIA GPUs only (CUDA), not on {gpu.describe()}"
    if gpu.cc < SONICMOE_FLOOR:
        return (f"it needs compute capability 9.0 or newer (Hopper, Blackwell; transformers' is_sonicmoe_loadable) "
                f"and {gpu.describe()} is below it")
    return None


def choose(cfg, gpu, load_kernel=None) -> Choice:
    """The experts forward for `cfg` on `gpu`. `load_kernel` (the trainer's, at model load): a callable that
    raises ImportError where the kernel cannot load here; None judges by the GPU's floor alone (validate, the
    dry run on another machine)."""
    name, key = asked(cfg)
    if name is None or name in RUN_HERE:
        return Choice(name, name, None)
    fallback = f"the experts run transformers' {FALLBACK} (the same matmuls; slower)"
    if name in NOT_PACKAGED:
        return Choice(name, FALLBACK, f"{key}: {NOT_PACKAGED[name]}: {fallback}")
    why = sonicmoe_runs_on(gpu)
    if why is None and load_kernel is not None:
        try:
            load_kernel()
        except ImportError as err:
            why = f"it cannot run here: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
    if why is not None:
        return Choice(name, FALLBACK, f"{key}: SonicMoE not used: {why}; {fallback}")
    return Choice(name, "sonicmoe", f"{key}: SonicMoE's CuTe DSL kernels (kernels-community/sonic-moe, through "
                                    f"transformers' sonicmoe experts forward) on {gpu.describe()}")


def load_sonicmoe() -> None:
    """Load SonicMoE's kernel now (transformers fetches it with `kernels`), so a kernel that cannot load is known
    before training starts. Raises ImportError."""
    # heavy: transformers' sonicmoe integration imports torch
    from transformers.integrations.sonicmoe import load_sonicmoe_kernel

    load_sonicmoe_kernel()


def experts_modules(model) -> list:
    """The model's experts blocks (classes transformers' `use_experts_implementation` decorates)."""
    return [m for m in model.modules() if hasattr(m, "has_post_expert_norm") and hasattr(m, "has_gate")]


def sonicmoe_fits(model) -> str | None:
    """None where transformers' sonicmoe experts forward takes this model's experts, else why not (its own checks,
    transformers 5.23 integrations/sonicmoe.py sonicmoe_experts_forward: gated experts, no post-expert norm, a
    silu/gelu/relu activation), so a model it cannot run is known at load, not at the first step."""
    # heavy: transformers' sonicmoe integration imports torch
    from transformers.integrations.sonicmoe import ACT_MAP

    for m in experts_modules(model):
        act = str(getattr(m.config, "hidden_act", "silu")).lower()
        misfit = ("no gate" if not m.has_gate else "a post-expert norm" if m.has_post_expert_norm
                  else None if act in ACT_MAP else f"the {act} activation")
        if misfit:
            return f"{type(m).__name__} has {misfit}, which transformers' sonicmoe experts forward does not take"
    return None


def apply(cfg, model, gpu, say=print) -> Choice:
    """Set the experts forward `choose` picks on the loaded model; on a GPU where SonicMoE's floor admits it, its
    kernel is loaded now and the model's experts checked, and a failure is said here (one line) before grouped_mm
    is set. A model without experts blocks: nothing set."""
    name, key = asked(cfg)
    if name is None or not experts_modules(model):
        return Choice(name, None, None)
    load = None
    if name == "sonicmoe" and sonicmoe_runs_on(gpu) is None:
        def load():
            misfit = sonicmoe_fits(model)
            if misfit:
                raise ImportError(misfit)
            load_sonicmoe()
    choice = choose(cfg, gpu, load)
    if load is not None and choice.runs == FALLBACK:  # the floor admitted it: the validate/dry-run note said it would run
        say(f"note: {choice.note}")
    model.set_experts_implementation(choice.runs)
    return choice
