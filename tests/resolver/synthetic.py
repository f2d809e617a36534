"""A small synthetic matrix for the solver's policy tests, so a data edit (a new torch or flash-attn release
in matrices/) never breaks a policy test. The GPU catalog, architectures, CUDA drivers, attention backends and
images are the real files (adding a GPU breaks nothing); the releases are made up: torch 3.0/3.1/3.2 with
CUDA 12.6 and 13.0 builds, flash-attn 9.x wheels for some of them, one xformers release, one training stack.
Tests add rows with `extra` to show how the policy reacts."""

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


TORCH = ('index_url = "https://torch.test/whl/{variant}"\n'
         + torch_release("3.0.0", {"cu126": OLD_SASS, "cu130": NEW_SASS})
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


def make(directory: Path, torch: str = "", flash_attn: str = "", xformers: str = "", packages: str = "") -> Path:
    """Write the synthetic matrix into `directory` (real catalog files, synthetic releases, plus extra rows)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in KEPT:
        shutil.copy(REAL / f"{name}.toml", directory / f"{name}.toml")
    (directory / "torch.toml").write_text(TORCH + torch)
    (directory / "flash_attn.toml").write_text(FLASH_ATTN + flash_attn)
    (directory / "xformers.toml").write_text(XFORMERS + xformers)
    (directory / "packages.toml").write_text(PACKAGES + packages)
    return directory
