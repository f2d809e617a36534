"""Axolotl's multimodal chat format: conversations whose turns list text and image parts, for `processor_type`.

A row (Axolotl's ProcessingStrategy.__call__, axolotl 0.19.0 processing_strategies.py):

- `messages` (or the entry's `field_messages`) in OpenAI's form, {role, content}; a legacy `conversations` list of
  {from, value} (human -> user, gpt -> assistant) is read the same way; a string content is one text part;
- a part is {type: text, text} or {type: image, path | base64 | url | image}; a row's `images` (or `image`) column
  puts its FIRST image into the first image part without a source, else appends it to the first user turn.

Images are read from this machine only: a path (absolute, else relative to the working directory, else to the
dataset file's directory) or base64 (optionally a data: URL). A `url` part is refused in one line naming the row:
training reads no network. Rows are checked and measured when the data is prepared (every image opened once) and
stored as JSON; the processor renders and encodes each batch (trainer/objectives/vision.py).

Which tokens are trained (Axolotl's process_labels): tokens inside a turn of a role in roles_to_train, by the chat
template's role boundaries (matrices/vision.toml, or the config's role_boundaries); the end marker per
train_on_eos (turn | all | none | last); never the pad token, the processor's image token or the template's media
tokens. train_on_inputs: every token but those.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from trainer import facts
from trainer.errors import ConfigError, DataError
from trainer.runtime.templates import render as budgeted  # the chat template under a time budget

ROLE_NAMES = {"human": "user", "gpt": "assistant"}
IMAGE_SOURCES = ("image", "url", "path", "base64")


# --- rows -> conversations -------------------------------------------------------------------------------------
def conversation(row: dict, field_messages: str, where: str, base_dir: Path | None) -> list[dict]:
    """The row's turns as [{role, content: [parts]}], image parts carrying a local `path` or `base64`.
    `where` names the row in errors ("dataset data.jsonl row 3")."""
    turns = None
    for name in (field_messages, "messages"):
        if row.get(name) is not None:
            turns = row[name]
            break
    if turns is None and row.get("conversations") is not None:
        turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: no conversation (a `{field_messages}` or `conversations` list of turns; "
                        f"columns: {', '.join(sorted(row)) or 'none'})")
    out = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{where}: turn {k} is not a mapping")
        if "from" in turn and "value" in turn and "role" not in turn:
            turn = {"role": turn["from"], "content": turn["value"]}
        role, content = turn.get("role"), turn.get("content")
        if not isinstance(role, str):
            raise DataError(f"{where}: turn {k} has no role")
        role = ROLE_NAMES.get(role, role)
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list) and all(isinstance(p, dict) for p in content):
            parts = [_part(p, f"{where} turn {k}", base_dir) for p in content]
        else:
            raise DataError(f"{where}: turn {k}'s content must be a string or a list of parts ({{type: text, text}} "
                            "or {type: image, path | base64})")
        out.append({"role": role, "content": parts})
    column = next((row[key] for key in ("images", "image") if row.get(key) is not None), None)
    if column is not None:  # Axolotl's backward-compatible image column: its first image only
        first = column[0] if isinstance(column, list) and column else column
        part = _part({"type": "image", **_column_image(first, where)}, f"{where} image column", base_dir)
        slot = next(((t, i) for t, turn in enumerate(out) for i, p in enumerate(turn["content"])
                     if p["type"] == "image" and not any(k in p for k in ("path", "base64"))), None)
        if slot is not None:
            out[slot[0]]["content"][slot[1]] = part
        else:
            first_user = next((t for t, turn in enumerate(out) if turn["role"] == "user"), 0)
            out[first_user]["content"].append(part)
    for turn in out:
        for p in turn["content"]:
            if p["type"] == "image" and not any(k in p for k in ("path", "base64")):
                raise DataError(f"{where}: an image part has no source (path or base64) and the row has no "
                                "`images` column to fill it")
    return out


def _column_image(value, where: str) -> dict:
    """An `images` column value: a path or base64 string, or what datasets' Image feature gives (bytes, a path)."""
    if isinstance(value, str):
        return {"base64": value} if _looks_base64(value) else {"path": value}
    if isinstance(value, dict) and value.get("bytes"):
        return {"base64": base64.b64encode(value["bytes"]).decode()}
    if isinstance(value, dict) and value.get("path"):
        return {"path": value["path"]}
    if hasattr(value, "save"):  # a PIL image
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return {"base64": base64.b64encode(buffer.getvalue()).decode()}
    raise DataError(f"{where}: the images column holds {type(value).__name__}, not an image path, base64 or bytes")


IMAGE_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"RIFF", b"BM", b"II*\x00", b"MM\x00*")


def _looks_base64(text: str) -> bool:
    """A data: URL, or base64 that decodes to an image file's first bytes (as transformers' load_image tries a
    string that is not a URL or a file as base64)."""
    if text.startswith("data:image/"):
        return True
    try:
        head = base64.b64decode(text[:64] + "=" * (-len(text[:64]) % 4), validate=True)
    except (binascii.Error, ValueError):
        return False
    return head.startswith(IMAGE_MAGIC)


def _part(part: dict, where: str, base_dir: Path | None) -> dict:
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise DataError(f"{where}: a text part needs `text`")
        return {"type": "text", "text": part["text"]}
    if kind != "image":
        raise DataError(f"{where}: part type {kind!r} is not supported here (text and image; audio and video are "
                        "not trained by this trainer)")
    if part.get("url") is not None:
        url = str(part["url"])
        if url.startswith("data:image/"):
            return {"type": "image", "base64": url}
        if "://" in url:
            raise DataError(f"{where}: image url {url[:120]} cannot be fetched (training reads no network); save "
                            "the image and give its `path`, or its `base64`")
        part = {**part, "path": url}
    if isinstance(part.get("base64"), str):
        return {"type": "image", "base64": part["base64"]}
    if isinstance(part.get("image"), str):
        part = {**part, **_column_image(part["image"], where)}
        if "base64" in part:
            return {"type": "image", "base64": part["base64"]}
    if isinstance(part.get("path"), str):
        return {"type": "image", "path": str(_local(part["path"], where, base_dir))}
    if part.get("image") is not None:
        return {"type": "image", **_column_image(part["image"], where)}
    return {"type": "image"}  # a placeholder the row's images column fills


def _local(path: str, where: str, base_dir: Path | None) -> Path:
    if "://" in path:
        raise DataError(f"{where}: image url {path[:120]} cannot be fetched (training reads no network); save "
                        "the image and give its `path`, or its `base64`")
    p = Path(path).expanduser()
    candidates = [p] if p.is_absolute() else [Path.cwd() / p] + ([base_dir / p] if base_dir else [])
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise DataError(f"{where}: image file not found: {path}" + ("" if p.is_absolute() else
                    f" (looked in {', '.join(str(c.parent) for c in candidates)})"))


# --- the processor -------------------------------------------------------------------------------------------
def load_processor(cfg, tokenizer):
    """Axolotl's load_processor: transformers' `processor_type` class from base_model_config or base_model (revision,
    processor_kwargs, trust_remote_code), its tokenizer replaced by the run's (special tokens, chat template)."""
    # heavy: transformers loads only when this runs
    import transformers

    cls = getattr(transformers, cfg.processor_type)
    source = cfg.base_model_config or cfg.base_model
    kwargs = dict(cfg.processor_kwargs or {})
    if cfg.revision_of_model:
        kwargs["revision"] = cfg.revision_of_model
    try:
        processor = cls.from_pretrained(source, trust_remote_code=cfg.trust_remote_code, **kwargs)
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"processor_type: cannot load a {cfg.processor_type} from {source}: "
                          f"{str(err).splitlines()[0][:300]}") from None
    if not hasattr(processor, "image_processor"):
        raise ConfigError(f"processor_type: {source} has no image processor ({type(processor).__name__}); "
                          "vision-language training needs one")
    processor.tokenizer = tokenizer
    processor.chat_template = tokenizer.chat_template  # the template the rows are rendered with, saved with it
    return processor


# --- images ----------------------------------------------------------------------------------------------------
RESAMPLING = {"bilinear": "BILINEAR", "bicubic": "BICUBIC", "lanczos": "LANCZOS"}


def load_image(part: dict, where: str, size=None, algorithm: str | None = None):
    """The part's image as RGB, resized as Axolotl does: an int size pads to a square keeping the aspect ratio
    (black bars), a (w, h) pair resizes; bilinear unless image_resize_algorithm says."""
    # optional: PIL is imported only where it is used
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        if "base64" in part:
            data = part["base64"].split(",", 1)[1] if part["base64"].startswith("data:") else part["base64"]
            image = Image.open(io.BytesIO(base64.b64decode(data, validate=False)))
        else:
            image = Image.open(part["path"])
        image.load()
    except (UnidentifiedImageError, binascii.Error, OSError, ValueError, Image.DecompressionBombError) as err:
        source = "base64 data" if "base64" in part else part.get("path")
        why = str(err).splitlines()[0][:200]
        if isinstance(err, Image.DecompressionBombError):  # Pillow's own limit on pixels: a bomb, or a huge image
            why = f"{why} (Pillow refuses images this large: shrink it, or drop the row)"
        raise DataError(f"{where}: cannot read the image ({source}): {why}") from None
    image = image.convert("RGB")
    if size is not None:
        method = getattr(Image.Resampling, RESAMPLING[algorithm or "bilinear"])
        if isinstance(size, (tuple, list)):
            image = image.resize(tuple(size), method)
        else:
            image = ImageOps.pad(image, (size, size), method=method, color=(0, 0, 0))
    return image


def processor_image_size(processor):
    """Axolotl's load_processor: with image_size unset, the processor's size {width, height} if it says one."""
    size = getattr(processor, "size", None) or getattr(getattr(processor, "image_processor", None), "size", None)
    if not isinstance(size, dict) or not ({"width", "height"} & set(size)):
        return None
    w, h = size.get("width"), size.get("height")
    return (w, h) if w is not None and h is not None else (w if w is not None else h)


# --- which tokens are trained ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Boundary:
    role: str
    start: tuple[int, ...]
    end: tuple[int, ...] = ()
    include_start: bool = False
    include_end: bool = True


@dataclass
class Masking:
    boundaries: list[Boundary]
    roles: frozenset[str]
    train_on_eos: str  # turn | all | none | last
    train_on_inputs: bool
    never: frozenset[int] = field(default_factory=frozenset)  # pad, image and media token ids
    source: str = ""  # where the boundaries came from, for the run's note
    template_kwargs: dict = field(default_factory=dict)  # the config's chat_template_kwargs, on every render


def template_row(name: str | None) -> dict | None:
    return next((r for r in facts.rows("vision", "template") if r["name"] == name), None)


def freeze_components() -> list[str]:
    return list(facts.table("vision")["freeze"]["components"])


def masking(cfg, tokenizer, processor) -> Masking:
    """The masking for this config (role boundaries from role_boundaries or the chat template's row)."""
    first = cfg.datasets[0] if cfg.datasets else None
    specs, source = None, ""
    if cfg.role_boundaries:
        specs, source = [b.model_dump() for b in cfg.role_boundaries], "role_boundaries"
    elif (row := template_row(cfg.chat_template)) is not None:
        specs, source = row["boundaries"], f"chat_template {cfg.chat_template} (matrices/vision.toml)"
    boundaries = [_boundary(s, i, tokenizer) for i, s in enumerate(specs or [])]
    never = {tokenizer.pad_token_id} if tokenizer.pad_token_id is not None else set()
    row = template_row(cfg.chat_template) or {}
    for token in [getattr(processor, "image_token", None), getattr(processor, "video_token", None),
                  *row.get("masked", [])]:
        if isinstance(token, str):
            ids = tokenizer.convert_tokens_to_ids(token)
            if isinstance(ids, int) and ids != tokenizer.unk_token_id:
                never.add(ids)
    return Masking(boundaries, frozenset(first.roles_to_train if first else ["assistant"]),
                   (first.train_on_eot or first.train_on_eos if first else None) or "turn", bool(cfg.train_on_inputs),
                   frozenset(never), source, dict(cfg.chat_template_kwargs or {}))


def _boundary(spec: dict, i: int, tokenizer) -> Boundary:
    encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    start = encode(spec["start"])
    if not start:
        raise ConfigError(f"role_boundaries.{i}.start: {spec['start']!r} encodes to no tokens")
    end_text = spec.get("end")
    if end_text is None:
        end = ()
    elif end_text == "eos_token":
        end = (tokenizer.eos_token_id,)
    else:
        end = encode(end_text)
        if not end:
            raise ConfigError(f"role_boundaries.{i}.end: {end_text!r} encodes to no tokens")
    return Boundary(spec["role"], start, end, bool(spec.get("include_start", False)),
                    bool(spec.get("include_end", True)))


def keep_mask(ids: list[int], m: Masking) -> list[bool]:
    """True where the token is trained (Axolotl's _compute_role_keep_mask, then pad and media tokens off):
    greedy left to right, the longest start marker wins; a turn of a trained role keeps its content, its start
    marker with include_start, and its end marker by train_on_eos."""
    n = len(ids)
    if m.train_on_inputs or not m.boundaries:
        keep = [True] * n
    else:
        keep = [False] * n
        last_end = None
        j = 0
        while j < n:
            best = None
            for b in m.boundaries:
                if ids[j:j + len(b.start)] == list(b.start) and (best is None or len(b.start) > len(best.start)):
                    best = b
            if best is None:
                j += 1
                continue
            content = j + len(best.start)
            found, after = False, n
            if best.end:
                k = content
                while k < n:
                    if ids[k:k + len(best.end)] == list(best.end):
                        found, after = True, k + len(best.end)
                        break
                    k += 1
            content_end = after - len(best.end) if found else after
            if best.role in m.roles:
                if best.include_start:
                    keep[j:content] = [True] * (content - j)
                keep[content:content_end] = [True] * (content_end - content)
                if found and best.include_end and m.train_on_eos not in ("none", "last"):
                    keep[content_end:after] = [True] * (after - content_end)
                if found and best.include_end and m.train_on_eos == "last":
                    last_end = (content_end, after)
            elif found and best.include_end and m.train_on_eos == "all":
                keep[content_end:after] = [True] * (after - content_end)
            j = after - len(best.end) if (found and not best.include_end and best.end) else after
        if last_end is not None:
            keep[last_end[0]:last_end[1]] = [True] * (last_end[1] - last_end[0])
    return [k and t not in m.never for k, t in zip(keep, ids)]


# --- one batch through the processor ---------------------------------------------------------------------------
def encode(conversations: list[list[dict]], processor, tokenizer, m: Masking, size=None, algorithm=None,
           where: list[str] | None = None) -> dict:
    """The processor's model inputs for these conversations (rendered by the tokenizer's chat template, images
    in order), with labels (-100 where not trained)."""
    # heavy: torch loads only when this runs
    import torch

    texts, images = [], []  # images: one list per conversation, as the processor's apply_chat_template passes them
    for i, turns in enumerate(conversations):
        texts.append(budgeted(tokenizer, turns, tokenize=False, add_generation_prompt=False, **m.template_kwargs))
        images.append([load_image(p, where[i] if where else "row", size, algorithm)
                       for turn in turns for p in turn["content"] if p["type"] == "image"])
    images = images if any(images) else None
    # everything the processor returns goes to the model, as Axolotl's collator passes it: pixel values, image grids,
    # Qwen2-VL's mm_token_type_ids (its multimodal rope), Gemma 3's token_type_ids (images attended both ways)
    # a template that renders the BOS itself is not given a second one (as the processor's apply_chat_template)
    bos = tokenizer.bos_token
    special = {"add_special_tokens": False} if bos is not None and texts[0].startswith(bos) else {}
    batch = dict(processor(text=texts, images=images, padding=True, return_tensors="pt", **special))
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    labels = ids.clone()
    for r in range(ids.shape[0]):
        keep = keep_mask(ids[r].tolist(), m)
        if mask is not None:
            keep = [k and bool(a) for k, a in zip(keep, mask[r].tolist())]
        labels[r][~torch.tensor(keep, dtype=torch.bool)] = -100
    batch["labels"] = labels
    return batch


# --- the prepared rows -----------------------------------------------------------------------------------------
def base_dir(ds) -> Path | None:
    if ds.path and Path(ds.path).expanduser().exists():
        p = Path(ds.path).expanduser().resolve()
        return p if p.is_dir() else p.parent
    files = [ds.data_files] if isinstance(ds.data_files, str) else list(ds.data_files or [])
    return Path(files[0]).expanduser().resolve().parent if files else None


def prepared_row(row: dict, index: int, ds, cfg, processor, tokenizer, m: Masking, size) -> dict:
    """One raw row -> {messages (JSON), length, targets, too_long}: checked and measured through the processor."""
    where = f"dataset {ds.source} row {index + 1}"  # counted from 1: a JSON Lines file's line number
    if row.get(ds.field_tools):  # Axolotl renders them for image conversations too; this path does not yet
        raise DataError(f"{where}: tool definitions ('{ds.field_tools}') in an image conversation are not rendered "
                        "here yet; remove the column (or train the conversations without images)")
    turns = conversation(row, ds.field_messages, where, base_dir(ds))
    batch = encode([turns], processor, tokenizer, m, size, cfg.image_resize_algorithm, [where])
    n = int(batch["input_ids"].shape[1])
    return {"messages": json.dumps(turns), "length": n, "too_long": n > cfg.sequence_len,
            "targets": int((batch["labels"][0, 1:] != -100).sum())}


def identity(processor, m: Masking, size) -> dict:
    """What the processor and the masking add to the prepared cache's key."""
    images = getattr(processor, "image_processor", None)
    settings = images.to_dict() if hasattr(images, "to_dict") else {}
    return {"kind": "vision", "processor": type(processor).__name__, "image_processor": settings,
            "boundaries": [vars(b) for b in m.boundaries], "never": sorted(m.never), "size": size,
            "roles": sorted(m.roles), "eos": m.train_on_eos}
