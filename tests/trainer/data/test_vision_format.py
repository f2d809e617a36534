"""Axolotl's multimodal chat format (trainer/data/formats/vision.py): rows read as Axolotl's ProcessingStrategy reads
them, images from this machine only (a URL refused naming the row), and the trained tokens chosen by the same
role-boundary scan as Axolotl's own (its _compute_role_keep_mask, run from the installed axolotl package's source as
the oracle over generated token sequences)."""

from __future__ import annotations

import ast
import base64
import io
import json
from pathlib import Path

import pytest
from tests.support import oracle

from trainer.data.formats import vision
from trainer.errors import DataError

ROOT = Path(__file__).resolve().parents[3]
AXOLOTL = ROOT / ".ci-cache" / "axolotl-oracle" / "axolotl" / "processing_strategies.py"


def png(colour=(10, 200, 10), size=(9, 7)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_row_reads_as_axolotl_reads_it(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    legacy = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}],
              "images": ["a.png", "ignored.png"]}
    turns = vision.conversation(legacy, "messages", "row 0", tmp_path)
    # human/gpt -> user/assistant, a string content is one text part, the column's FIRST image appended to the first
    # user turn (relative to the dataset's directory when not in the working directory)
    assert turns == [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                  {"type": "image", "path": str((tmp_path / "a.png").resolve())}]},
                     {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}]
    placeholder = {"chat": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image"}]}],
                   "image": [base64.b64encode(png()).decode()]}
    filled = vision.conversation(placeholder, "chat", "row 1", None)  # field_messages, and the placeholder filled
    assert filled[0]["content"][1]["type"] == "image" and "base64" in filled[0]["content"][1]
    assert vision.load_image(filled[0]["content"][1], "row 1").size == (9, 7)


@pytest.mark.parametrize("part, says", [
    ({"type": "image", "url": "https://example.com/bee.jpg"}, "row 3 turn 0: image url https://example.com/bee.jpg cannot "
                                                              "be fetched (training reads no network)"),
    ({"type": "image", "path": "nowhere.png"}, "row 3 turn 0: image file not found: nowhere.png"),
    ({"type": "image"}, "row 3: an image part has no source"),
    ({"type": "audio", "path": "a.wav"}, "part type 'audio' is not supported here"),
])
def test_what_cannot_be_read_here_is_one_line_naming_the_row(part, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    row = {"messages": [{"role": "user", "content": [part]}, {"role": "assistant", "content": "x"}]}
    with pytest.raises(DataError) as err:
        vision.conversation(row, "messages", "dataset d.jsonl row 3", tmp_path)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_unreadable_image_data_is_one_line(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"^row 0: cannot read the image \(.*bad.png\)"):
        vision.load_image({"type": "image", "path": str(tmp_path / "bad.png")}, "row 0")


def test_image_size_pads_to_a_square_or_resizes_as_axolotl():
    part = {"type": "image", "base64": "data:image/png;base64," + base64.b64encode(png(size=(20, 10))).decode()}
    square = vision.load_image(part, "r", size=16)
    assert square.size == (16, 16) and square.getpixel((0, 0)) == (0, 0, 0)  # black bars, aspect ratio kept
    assert vision.load_image(part, "r", size=(8, 12), algorithm="lanczos").size == (8, 12)


# --- the trained tokens: Axolotl's own scan as the oracle --------------------------------------------------------
def axolotl_scan():
    """RoleBoundary and _compute_role_keep_mask from the installed axolotl's processing_strategies.py, executed
    alone (the package's import pulls in far more than this function needs)."""
    oracle.require(AXOLOTL)
    tree = ast.parse(AXOLOTL.read_text())
    wanted = [n for n in tree.body if getattr(n, "name", None) in ("RoleBoundary", "_compute_role_keep_mask")]
    namespace: dict = {}
    exec("from dataclasses import dataclass, field\nfrom typing import Optional\nimport torch\n"  # noqa: S102
         "from torch import Tensor, zeros_like\n", namespace)
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(AXOLOTL), "exec"), namespace)  # noqa: S102
    return namespace["RoleBoundary"], namespace["_compute_role_keep_mask"]


def test_trained_tokens_match_axolotls_scan_over_generated_sequences():
    """300 token sequences drawn (seeded) from turn markers and text tokens, every train_on_eos, role set and
    boundary shape (shared markers, turns running to the end, include_start): the same tokens trained as Axolotl's."""
    import random

    import torch

    AxBoundary, ax_keep = axolotl_scan()
    # token ids 1-3 open turns, 4 closes them, 5 is a pixtral-style marker shared by two turns; 6-9 are text
    shapes = [[("system", [1], [4], True), ("user", [1, 7], [4], True), ("assistant", [2], [4], True)],
              [("user", [3], [5], False), ("assistant", [5], [4], True)],
              [("assistant", [2], [], True), ("user", [1], [4], True)]]
    draw = random.Random(0)
    for _ in range(300):
        include_start = draw.random() < 0.3
        specs = [(r, s, e, inc_end, include_start and r == "assistant") for r, s, e, inc_end in draw.choice(shapes)]
        ids = [draw.randint(1, 9) for _ in range(draw.randint(1, 30))]
        eos = draw.choice(["turn", "all", "none", "last"])
        roles = {r for r in ("system", "user", "assistant") if draw.random() < 0.5}
        ours = vision.keep_mask(ids, vision.Masking(
            [vision.Boundary(r, tuple(s), tuple(e), inc_start, inc_end) for r, s, e, inc_end, inc_start in specs],
            frozenset(roles), eos, False))
        theirs = ax_keep(torch.tensor([ids]), [AxBoundary(r, s, e, inc_start, inc_end)
                                               for r, s, e, inc_end, inc_start in specs], roles, eos)
        assert ours == theirs[0].tolist(), (ids, specs, eos, roles)


def test_pad_and_image_tokens_are_never_trained_and_train_on_inputs_trains_the_rest():
    m = vision.Masking([vision.Boundary("assistant", (2,), (4,))], frozenset({"assistant"}), "turn", False,
                       never=frozenset({0, 9}))
    assert vision.keep_mask([1, 9, 6, 4, 2, 7, 9, 4, 0], m) == [False] * 5 + [True, False, True, False]
    m.train_on_inputs = True
    assert vision.keep_mask([1, 9, 6, 4, 0], m) == [True, False, True, True, False]


def test_every_template_row_names_its_source_and_encodes_with_its_own_markers():
    rows = {r["name"]: r for r in vision.facts.rows("vision", "template")}
    assert {"qwen2_vl", "gemma3", "llama3_2_vision"} <= set(rows)
    for row in rows.values():
        assert row["source"].startswith("axolotl 0.19.0 processing_strategies.py")
        assert all(b["role"] and b["start"] for b in row["boundaries"])
    assert json.dumps(vision.freeze_components())  # [freeze] read as a list of names


def test_a_decompression_bomb_is_one_line_naming_the_image(tmp_path, monkeypatch):
    """An image over Pillow's pixel limit (issue 44 item 8) was a bare DecompressionBombError; now one DataError line
    naming the row's image. (The limit is lowered here: a real bomb is a 200-megapixel file.)"""
    from PIL import Image

    path = tmp_path / "big.png"
    Image.new("RGB", (64, 64)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 4096 pixels: over twice the limit, an error in Pillow
    with pytest.raises(DataError, match=rf"row 3: cannot read the image \({path}\): .*Pillow refuses images this "
                                        "large") as err:
        vision.load_image({"path": str(path)}, "row 3")
    assert "\n" not in str(err.value)
