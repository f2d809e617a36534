"""ReLoRA (arXiv 2307.05695), as Axolotl runs it (axolotl/monkeypatch/relora.py): every
`jagged_restart_steps` steps the LoRA update is merged into the base weights, LoRA starts again (A re-drawn
as peft initialises it, B zero), and the optimizer state of the LoRA weights is pruned (`relora_prune_method`:
magnitude, the default, keeps the largest 1 - `relora_prune_ratio` of each state tensor; random keeps a random
share; reset is random with ratio 0.999 unless one is given). The learning rate restarts with a short warmup
(trainer.optim.schedule: jagged restarts). The model's function does not change at a restart: only where the
update is kept does.

With a 4-bit base (QLoRA), merging into 4-bit weights would add a quantization error
at every restart; like Axolotl, the merge is done on full-precision copies of the LoRA-targeted weights
(read from base_model's files, kept on the CPU: 2 bytes per targeted parameter in bf16, 4 in fp32), which
are then quantized into the layers again.

Checkpoints hold those merged base weights (relora/base.safetensors) and the restart count, so a resumed run
continues with the same base. The final model is a full model (base with every merge and the last LoRA
folded in), not an adapter: the adapter alone would belong to a base that exists nowhere else.
"""

from __future__ import annotations

from pathlib import Path

from trainer.errors import TrainingError
from trainer.hooks import Hook, Saved

BASE_FILE = "relora/base.safetensors"  # a subfolder: the checkpoint's own *.safetensors are the model/adapter
FULL_RESET_RATIO = 0.999  # Axolotl's (and the paper's) near-full reset
STATE_KEYS = {"exp_avg": None, "exp_avg_sq": None, "state1": ("absmax1", "qmap1"), "state2": ("absmax2", "qmap2")}


def _prune(tensor, method: str, ratio: float, generator) -> None:
    # heavy: torch loads only when this runs
    import torch

    if method == "magnitude":
        magnitude = tensor.abs()
        threshold = torch.quantile(magnitude.flatten().float(), ratio).to(tensor.dtype)
        tensor.mul_((magnitude > threshold).to(tensor.dtype))
    else:  # random / reset
        keep = torch.rand(tensor.shape, generator=generator, dtype=torch.float32, device="cpu") > ratio
        tensor.mul_(keep.to(device=tensor.device, dtype=tensor.dtype))


def prune_optimizer_state(optimizer, params, method: str, ratio: float, seed: int) -> float:
    """Prune the Adam moments of `params` in place (8-bit ones through dequantize/quantize); return the share
    of their values now zero."""
    # heavy: torch and bitsandbytes load only when this runs
    import torch

    generator = torch.Generator().manual_seed(seed)
    zeros = total = 0
    for param in params:
        state = optimizer.state.get(param, {})
        for key, quantized in STATE_KEYS.items():
            value = state.get(key)
            if not torch.is_tensor(value):
                continue
            if value.dtype == torch.uint8:  # bitsandbytes' blockwise 8-bit state: prune the values, not codes
                import bitsandbytes.functional as F

                absmax, code = state[quantized[0]], state[quantized[1]]
                values = F.dequantize_blockwise(value, absmax=absmax, code=code, blocksize=256)
                _prune(values, method, ratio, generator)
                F.quantize_blockwise(values, code=code, blocksize=256, absmax=absmax, out=value)
                zeros += int((values == 0).sum())
            else:
                _prune(value, method, ratio, generator)
                zeros += int((value == 0).sum())
            total += value.numel()
    return zeros / total if total else 0.0


def _base_files(cfg) -> list[Path]:
    path = Path(cfg.base_model).expanduser()
    if not path.is_dir():
        # heavy: huggingface_hub loads only when this runs
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(cfg.base_model, revision=cfg.revision_of_model,
                                      allow_patterns=["*.safetensors", "*.json"]))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise TrainingError(f"relora: {cfg.base_model} has no *.safetensors weights to merge into")
    return files


def read_base_weights(cfg, keys: set[str], dtype) -> dict:
    # heavy: safetensors loads only when this runs
    from safetensors import safe_open

    out = {}
    for file in _base_files(cfg):
        with safe_open(str(file), "pt") as handle:
            for key in keys & set(handle.keys()):
                out[key] = handle.get_tensor(key).to(dtype)
    missing = sorted(keys - set(out))
    if missing:
        raise TrainingError(f"relora: base_model's files have no {missing[0]} to merge into")
    return out


class ReLoRA(Hook):
    def __init__(self, cfg, model, dtype, log=print, optimizer=None):
        # heavy: peft loads only when this runs
        import peft

        self.cfg, self.log, self.dtype, self.optimizer = cfg, log, dtype, optimizer
        self.every = cfg.jagged_restart_steps
        self.quantized = bool(cfg.load_in_4bit)
        self.method = cfg.relora_prune_method
        ratio = cfg.relora_prune_ratio
        self.ratio = ratio if ratio is not None else (FULL_RESET_RATIO if self.method == "reset" else 0.9)
        self.layers = {name.removeprefix("base_model.model.") + ".weight": module
                       for name, module in model.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)
                       and hasattr(module, "lora_A") and len(module.lora_A)}
        self.lora_params = [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]
        self.restarts = 0
        self.master = read_base_weights(cfg, set(self.layers), dtype) if self.quantized else {}
        log(f"ReLoRA: merging {len(self.layers)} LoRA layers into the base every {self.every} steps")

    # -- the base weights ------------------------------------------------------------------------------------
    def _delta(self, layer):
        # heavy: peft loads only when this runs
        import peft

        adapter = layer.active_adapter[0] if isinstance(layer.active_adapter, list) else layer.active_adapter
        device = "cpu" if self.cfg.relora_cpu_offload else layer.lora_A[adapter].weight.device
        delta = layer.lora_B[adapter].weight.detach().to(device).float() @ layer.lora_A[adapter].weight.detach().to(device).float()
        return peft.utils.transpose(delta, getattr(layer, "fan_in_fan_out", False)) * layer.scaling[adapter]

    def _set_base(self, layer, weight) -> None:
        """Put full-precision `weight` into the layer's base, quantizing it as the layer was."""
        base = layer.get_base_layer()
        old = base.weight
        if self.quantized:
            # heavy: bitsandbytes loads only when this runs
            import bitsandbytes as bnb

            base.weight = bnb.nn.Params4bit(weight.to(self.dtype).cpu(), requires_grad=False,
                                            quant_type=old.quant_type, blocksize=old.blocksize,
                                            compress_statistics=old.compress_statistics,
                                            quant_storage=old.quant_storage, module=base).to(old.device)
        else:
            old.data.copy_(weight.to(device=old.device, dtype=old.dtype))

    def base_weights(self) -> dict:
        """The merged base weights of the LoRA-targeted layers (what a checkpoint keeps)."""
        if self.quantized:
            return {k: v.contiguous() for k, v in self.master.items()}
        return {k: layer.get_base_layer().weight.detach().cpu().contiguous() for k, layer in self.layers.items()}

    def load(self, path: Path, restarts: int) -> None:
        # heavy: safetensors and torch load only when this runs
        from safetensors.torch import load_file

        weights = load_file(str(path))
        if set(weights) != set(self.layers):
            raise TrainingError(f"checkpoint {path.parent} does not hold this model's ReLoRA base weights")
        import torch

        with torch.no_grad():
            for key, layer in self.layers.items():
                if self.quantized:
                    self.master[key] = weights[key].to(self.dtype)
                self._set_base(layer, weights[key])
        self.restarts = restarts

    # -- the loop's hook --------------------------------------------------------------------------------------
    def start(self, state: dict, checkpoint: Path | None) -> None:
        if checkpoint is not None and "relora_restarts" in state:  # the merged base the checkpoint continues from
            self.load(checkpoint / BASE_FILE, state["relora_restarts"])

    def before_step(self, step: int) -> None:
        if step and step % self.every == 0:
            self.restart(self.optimizer, step)

    def on_save(self, step: int) -> Saved:
        return Saved(state={"relora_restarts": self.restarts}, tensors={BASE_FILE: self.base_weights()})

    def save_final(self, model, directory: Path, tokenizer) -> bool:
        self.write_final(model, directory, tokenizer)  # a full model: the merged base with the last LoRA folded in
        return True

    # -- the restart -----------------------------------------------------------------------------------------

    def restart(self, optimizer, step: int) -> None:
        # heavy: torch loads only when this runs
        import torch

        with torch.no_grad():
            for key, layer in self.layers.items():
                delta = self._delta(layer)
                if self.quantized:
                    self.master[key] += delta.to(device="cpu", dtype=self.master[key].dtype)
                    self._set_base(layer, self.master[key])
                else:
                    weight = layer.get_base_layer().weight
                    weight.data += delta.to(device=weight.device, dtype=weight.dtype)
                for adapter in layer.lora_A:
                    layer.reset_lora_parameters(adapter, True)
        share = prune_optimizer_state(optimizer, self.lora_params, self.method, self.ratio, seed=self.cfg.seed + step)
        self.restarts += 1
        self.log(f"ReLoRA: restart {self.restarts} at step {step + 1}: LoRA merged into the base and reset, "
                 f"{share:.1%} of its optimizer state zeroed")

    # -- the final model -------------------------------------------------------------------------------------
    def write_final(self, model, out_dir: Path, tokenizer) -> None:
        """A full model: the merged base with the current LoRA folded in."""
        # heavy: torch and transformers load only when this runs
        import torch

        if not self.quantized:
            model.merge_and_unload().save_pretrained(out_dir)
            return
        from transformers import AutoModelForCausalLM

        from trainer.model.load import resize_embeddings

        full = AutoModelForCausalLM.from_pretrained(self.cfg.base_model, dtype=self.dtype,
                                                    revision=self.cfg.revision_of_model,
                                                    trust_remote_code=self.cfg.trust_remote_code)
        resize_embeddings(self.cfg, full, tokenizer)
        params = dict(full.named_parameters())
        with torch.no_grad():
            trained = model.get_base_model()
            for name, param in trained.named_parameters():  # embeddings, norms, head: as they are in the run
                if name in params and param.dtype.is_floating_point and name not in self.layers:
                    params[name].copy_(param.to(params[name].dtype))
            for key, layer in self.layers.items():
                params[key].copy_((self.master[key] + self._delta(layer).to("cpu", self.master[key].dtype)).to(params[key].dtype))
        full.save_pretrained(out_dir)


def hook(cfg, model, optimizer, dtype, say=print) -> Hook | None:
    """ReLoRA merges LoRA into the base every jagged_restart_steps (one process only: checked by trainer.setup)."""
    return ReLoRA(cfg, model, dtype, say, optimizer=optimizer) if cfg.relora else None
