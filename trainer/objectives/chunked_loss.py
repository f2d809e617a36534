"""Cross-entropy over the vocabulary without the whole logits tensor (issue 32).

The unfused loss holds the head's output for every token of the micro-batch, its fp32 copy and log-softmax: at a
152k vocabulary and 4 x 4096 tokens that is most of a QLoRA run's memory. Here the model runs with its output head
swapped for an identity for the duration of one forward, so it returns its last hidden states; the head is then
applied to the target tokens only, a chunk at a time, each chunk under activation checkpointing (its logits are
recomputed in the backward instead of kept). Same loss and gradients as `F.cross_entropy` over the full logits
(tests/trainer/objectives/test_chunked_loss.py is the oracle test), in plain torch, on every device.

Where it runs: a model whose output head is a direct child of the causal LM (peft's base model included), whose
parameters are not sharded (FSDP2 and tensor parallelism make them DTensors, ZeRO-3 gathers them only inside the
model's own forward) and not compiled, and whose config names no change to the logits after the head (Gemma 2's
final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling, Falcon-H1's lm_head_multiplier: what
the head's input gets before it, as MiniCPM's scaling, is kept by the swap). Before the first use on a model, one
probe on a few tokens compares the head's output with the model's own logits in eval mode (no dropout, no random
numbers drawn); a difference or an error falls back to the full logits, with one note.

Chunk size: as many tokens as keep one chunk's fp32 logits within 256 MiB (trainer/runtime/loss_chunks.py, which
the memory estimate reads too). A step whose target logits fit one chunk runs it without checkpointing: nothing is
recomputed.

Which path a step takes, where the model allows both (`choose`): the config's `chunked_cross_entropy: true/false`
as Axolotl reads it; unset, the cheaper by the head's FLOPs (the chunked loss skips the prompt tokens but recomputes
its chunks when there are several), and the chunked loss wherever the full logits would take much of the free
memory (loss_chunks.choose_path: the rules and their reasons, as data). One note when a path is first taken.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.batch.labels import IGNORE
from trainer.runtime import loss_chunks

PROBE_TOKENS = 16
CHUNK_LOGITS_BYTES = loss_chunks.CHUNK_LOGITS_BYTES  # (tests make it small to run many chunks)
_decided: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (owner, name) or None
_notes: list[str] = []  # why a model fell back (read once by the loop's notes)
_chosen: dict = {"off": False, "setting": None, "num_chunks": None,  # what the run's config says (configure)
                 "token_scaling": False}
_taken: set = set()  # (path, rule) pairs already noted


def configure(cfg) -> None:
    """The config's say on the loss path, read once as a run starts: `chunked_cross_entropy: false` asks for the full
    logits (Axolotl's default path), `chunked_cross_entropy_num_chunks` for that many chunks of target tokens instead
    of the memory budget's size. Unset: each step's path chosen by cost (`choose`; the same loss and gradients)."""
    setting = getattr(cfg, "chunked_cross_entropy", None)
    _chosen.update(off=setting is False, setting=setting,
                   num_chunks=getattr(cfg, "chunked_cross_entropy_num_chunks", None),
                   token_scaling=bool(getattr(cfg, "token_scaling", False)))
    _decided.clear()
    _taken.clear()


class _HiddenOut(torch.nn.Module):
    """Stands in for the output head during one forward: returns what it is given, and records the autocast state
    and dtype the head would have run under, so the chunks run the head the same way."""

    def __init__(self):
        super().__init__()
        self.seen: dict = {}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kind = hidden.device.type
        enabled = torch.is_autocast_enabled(kind) if kind in ("cuda", "cpu", "xpu", "mps") else False
        self.seen = {"dtype": hidden.dtype, "device_type": kind, "autocast": enabled,
                     "autocast_dtype": torch.get_autocast_dtype(kind) if enabled else None}
        return hidden


def _inner(model):
    """The causal LM under the wrappers: accelerate/DDP/DeepSpeed's `.module`, then peft's base model."""
    inner = model
    while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
        inner = inner.module
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def _head_slot(model):
    """(owner, attribute name) of the output head, or (None, reason) where the chunked loss cannot run."""
    if hasattr(model, "_orig_mod") or hasattr(_inner(model), "_orig_mod"):
        return None, "the model is compiled"
    wrapper = model
    while isinstance(getattr(wrapper, "module", None), torch.nn.Module):
        if getattr(wrapper, "find_unused_parameters", False):  # DDP would call the head unused in the forward
            return None, "DDP looks for unused parameters (ddp_find_unused_parameters: true)"
        if "FullyShardedDataParallel" in type(wrapper).__name__:  # FSDP1 frees the head's weight after its forward
            return None, "the head's parameters are sharded (FSDP)"
        wrapper = wrapper.module
    base = _inner(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None:
        return None, "the model has no output head"
    name = next((n for n, child in base.named_children() if child is head), None)
    if name is None:
        return None, "the output head is not a direct child of the model"
    for p in head.parameters():
        if hasattr(p, "ds_id") or type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor":
            return None, "the head's parameters are sharded (FSDP2, ZeRO-3 or tensor parallel)"
    return (base, name), ""


def forward_hidden(model, owner, name, inputs):
    """One forward with the head swapped out: (hidden states [B, T, H], the head, how the head would have run)."""
    head = getattr(owner, name)
    stand_in = _HiddenOut()
    setattr(owner, name, stand_in)
    try:
        out = model(**inputs, use_cache=False)
    finally:
        setattr(owner, name, head)
    _keep_router_aux(out)
    return out.logits, head, stand_in.seen


_router: dict = {}  # the last forward's router auxiliary loss (MoE with output_router_logits), until taken


def _keep_router_aux(out) -> None:
    aux = getattr(out, "aux_loss", None)
    _router["aux"] = aux if isinstance(aux, torch.Tensor) else None


def take_router_aux():
    """The router auxiliary (load-balancing) loss of the last forward through this module, once; None without one."""
    return _router.pop("aux", None)


def head_logits(head, seen, h: torch.Tensor) -> torch.Tensor:
    """The head's output for hidden states h, in fp32, run as it would have run inside the model's forward (the
    autocast state and input dtype _HiddenOut recorded)."""
    with torch.autocast(seen["device_type"], dtype=seen["autocast_dtype"] or torch.float32,
                        enabled=bool(seen["autocast"])):
        return head(h.to(seen["dtype"])).float()


def ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of the targets (IGNORE left out); with liger_use_token_scaling each token's loss times its
    predicted probability, detached (Liger's fused linear cross-entropy with use_token_scaling, as Axolotl patches
    it in: the probability exp(-loss) of the target, from the same logits)."""
    losses = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="none")
    if _chosen["token_scaling"]:
        losses = losses * torch.exp(-losses.detach())
    return losses.sum()


def _chunk_loss(head, seen):
    return lambda h, y: ce_sum(head_logits(head, seen, h), y)


def loss_sum_from_hidden(hidden, head, seen, labels) -> torch.Tensor:
    """Sum of the target tokens' cross-entropy, the head applied a chunk of target tokens at a time."""
    h = hidden[:, :-1].flatten(0, 1)
    y = labels[:, 1:].flatten().to(h.device)
    keep = y != IGNORE
    h, y = h[keep], y[keep]
    if y.numel() == 0:  # zero, through the head as the full path's is: every parameter gets its (zero) gradient
        return _chunk_loss(head, seen)(hidden[:1, -1], torch.zeros(1, dtype=torch.long, device=hidden.device)) * 0.0
    vocab = head.out_features if hasattr(head, "out_features") else head.weight.shape[0]
    size = loss_chunks.chunk_tokens(y.numel(), vocab, CHUNK_LOGITS_BYTES, _chosen["num_chunks"])
    run = _chunk_loss(head, seen)
    recompute = torch.is_grad_enabled() and size < y.numel()  # one chunk: its logits kept, nothing recomputed
    total = None
    for i in range(0, y.numel(), size):
        part = (checkpoint(run, h[i:i + size], y[i:i + size], use_reentrant=False) if recompute
                else run(h[i:i + size], y[i:i + size]))
        total = part if total is None else total + part
    return total


def _chunk_logps(head, seen):
    return lambda h, y: -F.cross_entropy(head_logits(head, seen, h), y, reduction="none")


def token_logps_from_hidden(hidden, head, seen, ids, where) -> torch.Tensor:
    """Each next token's log-prob ([B, T-1], float32) at the positions `where` marks ([B, T-1] bool), 0 elsewhere:
    the head applied to those positions only, a chunk at a time (the preference objectives' sequence sums)."""
    h = hidden[:, :-1][where]
    y = ids[:, 1:][where]
    out = torch.zeros(where.shape, dtype=torch.float32, device=hidden.device)
    if y.numel() == 0:  # zero, through the head (every parameter gets its gradient)
        zero = _chunk_logps(head, seen)(hidden[:1, -1], torch.zeros(1, dtype=torch.long, device=hidden.device))
        return out + zero.sum() * 0.0
    vocab = head.out_features if hasattr(head, "out_features") else head.weight.shape[0]
    size = loss_chunks.chunk_tokens(y.numel(), vocab, CHUNK_LOGITS_BYTES, _chosen["num_chunks"])
    run = _chunk_logps(head, seen)
    recompute = torch.is_grad_enabled() and size < y.numel()  # one chunk: its logits kept, nothing recomputed
    parts = [checkpoint(run, h[i:i + size], y[i:i + size], use_reentrant=False) if recompute
             else run(h[i:i + size], y[i:i + size]) for i in range(0, y.numel(), size)]
    return out.masked_scatter(where, torch.cat(parts))


def token_log_sum_sq_from_hidden(hidden, head, seen, where) -> torch.Tensor:
    """log sum_v p_v^2 of each position's next-token distribution ([B, T-1], float32) at the positions `where` marks,
    0 elsewhere, without gradient: WPO's alignment term (TRL's `log_sum_sq_probs`), a chunk of positions at a time."""
    out = torch.zeros(where.shape, dtype=torch.float32, device=hidden.device)
    h = hidden[:, :-1][where]
    if h.shape[0] == 0:
        return out
    vocab = head.out_features if hasattr(head, "out_features") else head.weight.shape[0]
    size = loss_chunks.chunk_tokens(h.shape[0], vocab, CHUNK_LOGITS_BYTES, _chosen["num_chunks"])
    with torch.no_grad():
        parts = [log_sum_sq_probs(head_logits(head, seen, h[i:i + size])) for i in range(0, h.shape[0], size)]
    return out.masked_scatter(where, torch.cat(parts))


def log_sum_sq_probs(logits: torch.Tensor) -> torch.Tensor:
    """log sum_v softmax(logits)_v^2 over the last dimension (in fp32)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return torch.logsumexp(2 * log_probs, dim=-1)


def full_loss_sum(model, inputs, labels) -> torch.Tensor:
    out = model(**inputs, use_cache=False)
    _keep_router_aux(out)
    return ce_sum(out.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def _after_head(config) -> str:
    return loss_chunks.after_head(config.to_dict() if hasattr(config, "to_dict") else {})


def _probe(model, slot, inputs) -> str:
    """'' where the head applied to the swapped forward's hidden states gives the model's own logits on a few
    tokens (eval mode: no dropout, no random numbers drawn), else why not."""
    width = inputs["input_ids"].shape[1]
    n = min(width, PROBE_TOKENS)

    def first_tokens(v):  # the first row's first n tokens, on every dimension that runs over the tokens (4D masks)
        return v[(slice(0, 1), *(slice(0, n) if size == width else slice(None) for size in v.shape[1:]))]

    if any(not isinstance(v, torch.Tensor) or v.dim() < 2 for v in inputs.values()):
        return "its inputs are not per-token"
    cut = {k: first_tokens(v) for k, v in inputs.items()}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = model(**cut, use_cache=False).logits.float()
            hidden, head, seen = forward_hidden(model, *slot, cut)
            got = head_logits(head, seen, hidden)
    except Exception as error:  # noqa: BLE001 - any failure means: use the full logits, and say why
        return f"the probe raised {type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    finally:
        model.train(was_training)
    low = seen["dtype"] in (torch.bfloat16, torch.float16) or seen["autocast"]
    rtol = 2e-2 if low else 1e-5
    if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=rtol * float(want.abs().max())):
        return "the model changes its logits after the head (the probe's logits differ)"
    return ""


def decide(model, inputs):
    """The head slot for the chunked loss on this model, or None (decided once per model, noted once)."""
    if model in _decided:
        return _decided[model]
    if _chosen["off"]:
        _decided[model] = None
        _notes.append("loss: full logits (chunked_cross_entropy: false)")
        return None
    slot, why = _head_slot(model)
    if slot is not None:
        transform = _after_head(getattr(slot[0], "config", None))
        why = f"the model changes its logits after the head ({transform})" if transform else _probe(model, slot, inputs)
    _decided[model] = slot if not why else None
    if why:  # where it runs, `choose` says which path each step takes
        _notes.append(f"loss: full logits (the chunked cross-entropy does not run here: {why})")
    return _decided[model]


def choose(slot, positions: int, targets: int) -> loss_chunks.LossPath:
    """This step's loss path on a model where both run (`decide` gave `slot`): `positions` tokens in the micro-batch,
    `targets` of them scored (loss_chunks.choose_path). A path's first use is noted with its reason."""
    head = getattr(*slot)
    params = list(head.parameters())  # a LoRA on the head: its adapter trains, its base weight does not
    vocab = head.out_features if hasattr(head, "out_features") else head.weight.shape[0]
    hidden = head.in_features if hasattr(head, "in_features") else head.weight.shape[1]
    path = loss_chunks.choose_path(positions, targets, (vocab, hidden),
                                   head_trains=any(p.requires_grad for p in params), setting=_chosen["setting"],
                                   num_chunks=_chosen["num_chunks"], free_bytes=free_bytes(params[0].device),
                                   budget=CHUNK_LOGITS_BYTES)
    if (path.path, path.rule) not in _taken:
        _taken.add((path.path, path.rule))
        what = "chunked cross-entropy" if path.path == "chunked" else "full logits"
        _notes.append(f"loss: {what}: {path.reason}")
    return path


def free_bytes(device: torch.device) -> float | None:
    """Memory free on `device` now: the GPU's (torch.cuda.mem_get_info), the host's MemAvailable on the CPU; None where
    neither says."""
    try:
        if device.type == "cuda":
            return float(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu" and os.path.exists("/proc/meminfo"):
            with open("/proc/meminfo") as f:
                line = next((x for x in f if x.startswith("MemAvailable:")), None)
            return float(line.split()[1]) * 1024 if line else None
    except (RuntimeError, OSError, ValueError):
        return None
    return None


def notes() -> list[str]:
    """The loss path's notes not yet shown (each shown once)."""
    out = list(_notes)
    _notes.clear()
    return out
