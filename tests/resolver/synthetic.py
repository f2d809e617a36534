"""A small synthetic matrix for the solver's policy tests, so a data edit (a new torch or flash-attn release
in matrices/) never breaks a policy test. The GPU catalog, architectures, CUDA drivers, attention backends and
images are the real files (adding a GPU breaks nothing); the releases are made up: torch 3.0/3.1/3.2 with
CUDA 12.6 and 13.0 builds, a varlen kernel built into torch from 3.1, flash-attn 9.x wheels for some of them,
one xformers release, one training stack. Tests add rows with `extra` (or drop the built-in varlen kernel) to
show how the policy reacts."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import matrices

REAL = Path(matrices.__file__).parent
KEPT = ("meta", "attention", "archs", "gpus", "cuda", "images")

OLD_SASS = '["5.0", "6.0", "7.0", "7.5", "8.0", "8.6", "9.0"]'
NEW_SASS = '["7.5", "8.0", "8.6", "9.0", "10.0", "12.0"]'


def torch_release(version: str, builds: dict[str, str], python: str = ">=3.10,<3.14", triton: str = "9.0.0") -> str:
    rows = "".join(textwrap.dedent(f"""
        [[release.build]]
        variant = "{variant}"
        cuda = "{variant[2:-1]}.{variant[-1]}"
        status = "stable"
        sass = {sass}
        source = "synthetic"
        """) for variant, sass in builds.items())
    return textwrap.dedent(f"""
        [[release]]
        version = "{version}"
        python = "{python}"
        triton = "{triton}"
        cxx11abi = true
        source = "synthetic"
        """) + rows


def flash_attn_release(version: str, torch: list[str], impl: str = "fa2", cuda: str = '{ "12" = "12" }') -> str:
    return textwrap.dedent(f"""
        [[release]]
        version = "{version}"
        impl = "{impl}"
        filename = "flash_attn-{{version}}+cu{{cuda}}torch{{torch}}cxx11abi{{abi}}-cp{{py}}-cp{{py}}-linux_{{platform}}.whl"
        torch = {torch!r}
        cuda = {cuda}
        python = ["3.10", "3.11", "3.12", "3.13"]
        cxx11abi = [true, false]
        platforms = ["x86_64"]
        source = "synthetic"
        """).replace("'", '"')


def varlen(torch: str = ">=3.1", min_cc: str = "8.0") -> str:
    """torch's own mask-free packing kernel, FA2-class, from `torch` on."""
    return textwrap.dedent(f"""
        [[varlen]]
        name = "varlen_attn"
        function = "torch.nn.attention.varlen.varlen_attn"
        torch = "{torch}"
        min_cc = "{min_cc}"
        attention = "sdpa"
        counts_as = "flash_attention_2"
        source = "synthetic"
        """)


def cudnn_sdpa(torch: str = ">=3.1", cuda: str = ">=13.0", min_cc: str = "9.0", max_cc: str = "10.3") -> str:
    """Builds whose SDPA puts cuDNN attention first on these GPUs."""
    return textwrap.dedent(f"""
        [[cudnn_sdpa]]
        torch = "{torch}"
        cuda = "{cuda}"
        min_cc = "{min_cc}"
        max_cc = "{max_cc}"
        bugs = "synthetic mask bug"
        source = "synthetic"
        """)


def fa3_index_release(version: str, min_torch: str, variants: list[str]) -> str:
    """A flash-attn-3 release on the PyTorch index: one abi3 wheel per platform in each variant's folder."""
    return textwrap.dedent(f"""
        [[release]]
        version = "{version}"
        impl = "fa3"
        index = "torch"
        filename = "flash_attn_3-{{version}}-cp39-abi3-{{platform_tag}}.whl"
        min_torch = "{min_torch}"
        min_python = "3.9"
        variants = {variants!r}
        cxx11abi = [true, false]
        platforms = ["x86_64", "aarch64"]
        platform_tags = {{ x86_64 = "manylinux_2_28_x86_64", aarch64 = "manylinux_2_34_aarch64" }}
        source = "synthetic"
        """).replace("'", '"')


def kernels(transformers_range: str, *releases: str, transformers: str = "9.0.0") -> str:
    """What the stack's transformers requires of `kernels`, and the kernels releases that exist."""
    rows = textwrap.dedent(f"""
        [[kernels_requirement]]
        transformers = "{transformers}"
        kernels = "{transformers_range}"
        source = "synthetic"
        """)
    return rows + "".join(textwrap.dedent(f"""
        [[kernels_release]]
        version = "{v}"
        source = "synthetic"
        """) for v in releases)


TORCH_RELEASES = (torch_release("3.0.0", {"cu126": OLD_SASS, "cu130": NEW_SASS})
                  + torch_release("3.1.0", {"cu126": OLD_SASS, "cu130": NEW_SASS})
                  + torch_release("3.2.0", {"cu130": NEW_SASS}))

FLASH_ATTN = textwrap.dedent("""
    wheel_url = "https://fa.test/v{version}/{filename}"

    [[impl]]
    name = "fa2"
    attention = "flash_attention_2"
    package = "flash-attn"
    source = "synthetic"

    [[impl]]
    name = "fa3"
    attention = "flash_attention_3"
    package = "flash-attn-3"
    min_cuda = "12.3"
    source = "synthetic"
    """) + flash_attn_release("9.0", ["3.0"])

XFORMERS = textwrap.dedent("""
    [[release]]
    version = "0.9.0"
    torch = ">=3.0"
    min_cc = "7.5"
    source = "synthetic"
    """)

PACKAGES = textwrap.dedent("""
    no_build = ["torch", "flash-attn"]

    [[stack]]
    torch = ">=3.0"
    python = ">=3.10"
    packages = { transformers = "9.0.0", peft = "1.0.0", bitsandbytes = "1.0.0" }
    source = "synthetic"

    [[gpu_requirement]]
    package = "bitsandbytes"
    min_cc = "6.0"
    reason = "synthetic: needs sm_60+"
    source = "synthetic"

    [[triton_support]]
    triton = ">=9.0"
    min_cc = "7.5"
    reason = "synthetic: no Volta"
    source = "synthetic"

    [[feature]]
    name = "bnb_4bit"
    package = "bitsandbytes"
    config = "load_in_4bit"
    min_cc = "6.0"
    cpu = true
    reason = "synthetic"
    source = "synthetic"
    """)


def make(directory: Path, torch: str = "", flash_attn: str = "", xformers: str = "", packages: str = "",
         builtin_varlen: str | None = None) -> Path:
    """Write the synthetic matrix into `directory` (real catalog files, synthetic releases, plus extra rows).
    builtin_varlen: the [[varlen]] rows (default: varlen_attn from torch 3.1; "" for a torch without one)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in KEPT:
        shutil.copy(REAL / f"{name}.toml", directory / f"{name}.toml")
    rows = varlen() if builtin_varlen is None else builtin_varlen
    (directory / "torch.toml").write_text('index_url = "https://torch.test/whl/{variant}"\n' + rows + torch
                                          + TORCH_RELEASES)
    (directory / "flash_attn.toml").write_text(FLASH_ATTN + flash_attn)
    (directory / "xformers.toml").write_text(XFORMERS + xformers)
    (directory / "packages.toml").write_text(PACKAGES + packages)
    return directory
