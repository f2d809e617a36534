"""One manifest rule for checkpoints and dataset caches (issue 33, item 3; trainer/runtime/digest.py): a manifest
proves only what it lists, so one that lists less than its folder holds, or an entry without a size or hash, is
damage: the checkpoint is skipped for the previous one with the reason, the cache is prepared again; never a
KeyError, never a resume of altered weights or a training on altered rows.

The oracle for the rule: over generated manifests (mutations of the true one), a folder verifies exactly when its
manifest is the one `describe` writes for it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.trainer.helpers import run_cli
from trainer.cli import main
from trainer.runtime import digest


def _folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True, exist_ok=True)
    (root / "model.safetensors").write_bytes(b"weights" * 50)
    (root / "optimizer.pt").write_bytes(b"moments")
    (root / "sub" / "data-00000-of-00001.arrow").write_bytes(b"rows" * 20)
    (root / "empty.json").write_bytes(b"")
    return root


values = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.text(max_size=70), st.floats(allow_nan=True),
                   st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=8), st.integers(), max_size=2))
mutation = st.one_of(
    st.tuples(st.just("drop"), st.integers(0, 9)),
    st.tuples(st.just("drop-key"), st.integers(0, 9), st.sampled_from(["size", "sha256"])),
    st.tuples(st.just("set-key"), st.integers(0, 9), st.sampled_from(["size", "sha256"]), values),
    st.tuples(st.just("replace-entry"), st.integers(0, 9), values),
    st.tuples(st.just("add"), st.sampled_from(["../outside", "/etc/passwd", "missing.bin", "sub", "", "a\\b"]), values),
    st.tuples(st.just("whole"), values),
)


def _mutate(files: dict, change) -> object:
    files = json.loads(json.dumps(files))
    names = sorted(files)
    kind = change[0]
    if kind == "whole":
        return change[1]
    if kind == "add":
        files[change[1]] = change[2] if change[2] is not None else {"size": 0, "sha256": "0" * 64}
        return files
    name = names[change[1] % len(names)]
    if kind == "drop":
        del files[name]
    elif kind == "drop-key" and isinstance(files[name], dict):
        files[name].pop(change[2], None)
    elif kind == "set-key" and isinstance(files[name], dict):
        files[name][change[2]] = change[3]
    elif kind == "replace-entry":
        files[name] = change[2]
    return files


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return _folder(tmp_path_factory.mktemp("manifest"))


@given(st.lists(mutation, min_size=1, max_size=3))
@settings(max_examples=150, deadline=None)
def test_a_folder_verifies_exactly_when_its_manifest_proves_every_file(folder, changes):
    truth = digest.describe(folder, "manifest.json")
    files = truth
    for change in changes:
        files = _mutate(files, change) if isinstance(files, dict) and files else change
    wrong = digest.damage(folder, files, "manifest.json")  # never an exception, whatever the manifest holds
    same = json.dumps(files, sort_keys=True) == json.dumps(truth, sort_keys=True)  # (False == 0 in Python)
    assert (wrong is None) == same, (files, wrong)
    assert wrong is None or ("\n" not in wrong and len(wrong) < 400)


def test_the_reasons_name_the_file_and_what_is_missing(tmp_path):
    root = _folder(tmp_path / "c")
    truth = digest.describe(root, "manifest.json")
    assert digest.damage(root, truth, "manifest.json") is None
    assert digest.damage(root, {}, "manifest.json") == (
        "empty.json (and 3 more) is not in manifest.json, which proves only what it lists")
    no_size = {**truth, "model.safetensors": {"sha256": truth["model.safetensors"]["sha256"]}}
    assert digest.damage(root, no_size, "manifest.json") == "manifest.json entry 'model.safetensors' has no size"
    outside = {**truth, "../x": {"size": 1, "sha256": "0" * 64}}
    assert digest.damage(root, outside, "manifest.json") == "manifest.json names '../x', outside its folder"
    (root / "model.safetensors").write_bytes(b"W" + b"weights"[1:] + b"weights" * 49)  # same size, other bytes
    assert digest.damage(root, truth, "manifest.json") == ("the bytes of model.safetensors changed since it was "
                                                          "written (its sha256 does not match the manifest)")
    assert digest.damage(root, truth, "manifest.json", hash_limit=10) is None  # a large cache: sizes only


@pytest.mark.slow
def test_a_checkpoint_whose_manifest_proves_less_is_skipped_for_the_previous_one(make_config, tmp_path, capsys):
    out = tmp_path / "out"
    config = make_config(output_dir=str(out), max_steps=4, save_steps=2, auto_resume_from_checkpoints=True)
    assert main(["train", str(config)]) == 0
    runs = {}
    for case in ("lists nothing", "no size"):
        copy = tmp_path / case.replace(" ", "-")
        shutil.copytree(out, copy)
        newest = copy / "checkpoint-4"
        manifest = json.loads((newest / "manifest.json").read_text())
        if case == "lists nothing":  # and the weights overwritten: a manifest that proves nothing
            manifest["files"] = {}
            weights = next(p for p in newest.iterdir() if p.suffix == ".safetensors")
            data = bytearray(weights.read_bytes())
            data[len(data) // 2: len(data) // 2 + 64] = b"\x7f" * 64
            weights.write_bytes(bytes(data))
        else:
            del manifest["files"]["trainer_state.json"]["size"]
        (newest / "manifest.json").write_text(json.dumps(manifest))
        shutil.rmtree(copy / "final")
        capsys.readouterr()
        assert main(["train", str(make_config(f"{copy.name}.yml", output_dir=str(copy), max_steps=4, save_steps=2,
                                              auto_resume_from_checkpoints=True))]) == 0
        runs[case] = capsys.readouterr().err
        assert f"resumed from {copy / 'checkpoint-2'} at step 2" in runs[case], runs[case][-3000:]
        assert "KeyError" not in runs[case] and "Traceback" not in runs[case]
    assert (f"note: skipping {tmp_path / 'lists-nothing' / 'checkpoint-4'}: " in runs["lists nothing"]
            and "is not in manifest.json, which proves only what it lists; trying the previous checkpoint"
            in runs["lists nothing"])
    assert (f"note: skipping {tmp_path / 'no-size' / 'checkpoint-4'}: manifest.json entry 'trainer_state.json' has "
            "no size; trying the previous checkpoint") in runs["no size"]


@pytest.mark.slow
def test_a_dataset_cache_whose_manifest_proves_less_is_prepared_again(make_config, tmp_path):
    config = make_config()
    first = run_cli("preprocess", str(config), "--json")
    assert first.returncode == 0, first.stderr
    cache = tmp_path / "prepared" / json.loads(first.stdout)["path"].rsplit("/", 1)[-1]
    assert main(["train", str(config)]) == 0  # a run reads the cache: it adds nothing its manifest would not prove
    again = run_cli("preprocess", str(config), "--json")
    assert again.returncode == 0 and "damaged" not in again.stderr, again.stderr
    arrow = next((cache / "train").glob("*.arrow"))
    original = arrow.read_bytes()
    with open(arrow, "r+b") as f:  # rows altered, size kept, and a manifest that lists nothing
        f.seek(len(original) // 2)
        f.write(bytes(4096))
    (cache / "manifest.json").write_text("{}")
    again = run_cli("preprocess", str(config), "--json")
    assert again.returncode == 0, again.stderr
    assert f"the dataset cache {cache} is damaged (" in again.stderr
    assert "is not in manifest.json, which proves only what it lists): preparing it again" in again.stderr
    assert arrow.read_bytes() == original  # rebuilt: the rows it had
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest[f"train/{arrow.name}"].pop("sha256")
    (cache / "manifest.json").write_text(json.dumps(manifest))
    again = run_cli("preprocess", str(config), "--json")
    assert again.returncode == 0 and "KeyError" not in again.stderr, again.stderr
    assert f"(manifest.json entry 'train/{arrow.name}' has no sha256): preparing it again" in again.stderr
