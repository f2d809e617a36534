"""The one feature list (trainer/config/features.py) as the config and the layers read it: the keys a feature
declares are fields of Config and rows of the resume table, never a section's key too; every function an entry
names by Ref is a function, of a module trainer/features.py (the layer that calls it) may import."""

from __future__ import annotations

import tomllib

import pytest

from tests.trainer.helpers import REPO
from trainer.config import resume
from trainer.config.features import FEATURES, RESUME_CLASSES, Ref, keys
from trainer.config.schema import Config, FeatureKeys

REFS = [(f.name, attr, getattr(f, attr)) for f in FEATURES for attr in ("uses", "hook", "notes", "line")
        if isinstance(getattr(f, attr), Ref)]


def _layer(module: str, layers: list[str]) -> int:
    wing = ".".join(module.split(".")[:2])
    return next(i for i, layer in enumerate(layers) if wing in {m.strip() for m in layer.split("|")})


def test_each_feature_key_is_a_config_field_with_its_resume_class_and_no_section_declares_it():
    declared = keys()
    sections = {name for base in Config.__mro__[1:] if base is not FeatureKeys
                for name in getattr(base, "model_fields", {})}  # (each section's own keys)
    assert set(declared) <= set(Config.model_fields)
    assert set(declared) & sections == set(), "a feature declares a key a section declares too: one of them must go"
    for name, key in declared.items():
        assert key.resume in RESUME_CLASSES and resume.CLASSES[name] == key.resume, name


@pytest.mark.parametrize("feature, attr, ref", REFS, ids=[f"{n}.{a}" for n, a, _ in REFS])
def test_each_ref_is_a_function_that_trainer_features_may_import(feature, attr, ref):
    """import-linter does not see a Ref (a name, imported when called): this is its check instead."""
    layers = next(c for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
                  if c["id"] == "trainer-layers")["layers"]
    module = ref.target.partition(":")[0]
    assert callable(ref.function()), ref
    assert _layer(module, layers) >= _layer("trainer.features", layers), f"{ref.target}: above trainer.features"
