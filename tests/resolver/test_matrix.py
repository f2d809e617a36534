"""Every matrix loads and passes the schema; a malformed row is rejected naming its file and row."""

import shutil

import pytest

from resolver import matrix
from resolver.errors import MatrixError


def test_every_matrix_loads_with_a_source_on_every_row(m):
    assert m.version
    rows = [*m.archs, *m.gpus, *m.cuda_majors, *m.toolkits, *m.torch, *m.flash_attn_impls,
            *m.flash_attn_releases, *m.xformers, *m.stacks, *m.gpu_requirements, *m.triton_support]
    rows += [b for r in m.torch for b in r.build]
    assert all(row.source.strip() for row in rows)


@pytest.fixture
def matrix_copy(tmp_path):
    target = tmp_path / "matrices"
    shutil.copytree(matrix.matrix_dir(), target, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    return target


def edit(path, old, new):
    text = path.read_text()
    assert old in text, f"{old!r} not in {path.name}"
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("file, old, new, expected", [
    ("gpus.toml", 'compute_capability = "7.5"', 'compute_capability = "sm75"',
     "gpus.toml [[gpu]] (Tesla T4): compute capability 'sm75'"),
    ("gpus.toml", 'memory_gb = 16\n', 'memory_gb = "16"\n', "gpus.toml [[gpu]] #1 (name=Tesla P100): field 'memory_gb' must be float"),
    ("torch.toml", 'triton = "3.7.1"', 'trition = "3.7.1"', "unknown field 'trition'"),
    ("torch.toml", 'cuda = "12.6"', 'cuda = "12.7"', "CUDA 12.7 has no cuda.toml [[toolkit]] row"),
    ("torch.toml", 'status = "stable"', 'status = "beta"', "status must be 'stable' or 'experimental'"),
    ("flash_attn.toml", 'impl = "fa2"', 'impl = "fa9"', "impl 'fa9' has no [[impl]] row"),
    ("cuda.toml", 'min_driver = "560.28.03"', 'min_driver = 560', "field 'min_driver' must be str"),
    ("packages.toml", 'torch = ">=2.6"', 'torch = "newer than 2.6"', "is not a version range"),
    ("gpus.toml", 'aliases = ["a10g"]', 'aliases = ["a10"]', "alias 'a10' also names NVIDIA A10"),
])
def test_malformed_row_is_rejected_naming_file_and_row(matrix_copy, file, old, new, expected):
    edit(matrix_copy / file, old, new)
    with pytest.raises(MatrixError) as err:
        matrix.load(matrix_copy)
    assert expected in str(err.value)
    assert file in str(err.value)


def test_missing_field_names_the_row(matrix_copy):
    edit(matrix_copy / "torch.toml", 'cxx11abi = false\n', "")
    with pytest.raises(MatrixError, match=r"torch.toml \[\[release\]\] #1 \(version=2.4.1\): missing field 'cxx11abi'"):
        matrix.load(matrix_copy)


def test_invalid_toml_names_the_file(matrix_copy):
    (matrix_copy / "cuda.toml").write_text("[[toolkit]\nversion = ")
    with pytest.raises(MatrixError, match="cuda.toml: not valid TOML"):
        matrix.load(matrix_copy)


def test_matrix_dir_override(matrix_copy, monkeypatch):
    edit(matrix_copy / "meta.toml", 'version = "', 'version = "test-')
    monkeypatch.setenv("ENVTOOL_MATRIX_DIR", str(matrix_copy))
    assert matrix.load(matrix.matrix_dir()).version.startswith("test-")


def test_arch_for_falls_back_within_the_major(m):
    assert m.arch_for("8.9").name == "ada"
    assert m.arch_for("12.1").compute_capability == "12.0"  # GB10 runs sm_120 code
    assert m.arch_for("5.3").compute_capability == "5.2"  # Jetson Nano runs sm_52 code
    assert m.arch_for("3.5") is None  # no row at or below 3.5 in Kepler's major: refused, not guessed


@pytest.mark.parametrize("version, spec", [
    ("3.11", ">=3.10,<3.15"), ("3.15", ">=3.10,<3.15"), ("3.9", ">=3.10"), ("2.8.0", ">=2.6"),
    ("2.5.1", "<2.6"), ("3.3.1", ">=3.3"), ("3.2.0", ">=3.3"), ("2.4.1", "==2.4.1"), ("2.4.1", "!=2.4.1"),
    ("3.10", "<=3.10"), ("3.10", ">3.10"),
])
def test_in_range_agrees_with_packaging_specifiers(version, spec):
    from packaging.specifiers import SpecifierSet

    assert matrix.in_range(version, spec) == (version in SpecifierSet(spec))


def test_the_cache_gives_the_same_matrix_and_follows_edits(matrix_copy, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fresh = matrix._load(matrix_copy)
    assert matrix.load(matrix_copy) == fresh  # written to the cache
    assert list((tmp_path / "cache" / "envtool").glob("matrix-*.json"))
    matrix.load.cache_clear()
    assert matrix.load(matrix_copy) == fresh  # read back from it
    edit(matrix_copy / "meta.toml", 'version = "', 'version = "edited-')
    matrix.load.cache_clear()
    assert matrix.load(matrix_copy).version.startswith("edited-")
