# Compute capabilities each (cuda_version, host arch) wheel is built for, as
# the same {cc_int} representation used by torch/cuda/__init__.py:
# `50 == 5.0`, `120 == 12.0`. Kept in sync with PYTORCH_RELEASES_CODE_CC by
# validate_runtime_release_table_consistency() in
# .github/scripts/generate_binary_build_matrix.py.
TORCH_CUDA_ARCH_LIST_TABLE: dict[str, dict[str, set[int]]] = {
    "12.6": {
        "x86_64": {50, 60, 70, 75, 80, 86, 90},
        "aarch64": {80, 90},
    },
    "13.0": {
        "x86_64": {75, 80, 86, 90, 100, 120},
        "aarch64": {80, 90, 100, 110, 120},
    },
    "13.2": {
        "x86_64": {75, 80, 86, 90, 100, 120},
        "aarch64": {80, 90, 100, 110, 120},
    },
}

# Architectures we additionally emit PTX for (forward-compat for newer GPUs).
_PTX_ARCHES: set[int] = {120}
