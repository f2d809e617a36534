"""uv's failure text, as the two forms CI met under load (2026-11-28), is still read for the package it names: a
resolution split by markers names the missing package mid-sentence, and uv wraps a long wheel URL onto its own line.
Before this, both fell through to "uv says: ..." (exit 1): the first named no package or wheel, and the second
named it only when uv did not wrap, so the same index gave exit 1 or 2 from run to run."""

from resolver.uvrun import MissingWheel, explain_failure

# (CI's log kept these lines' beginnings -- "error: No solution found when resolving dependencies for split (markers:",
# "cause: Because all versions of torch depend on", "error: Failed to download `flash-attn @", "cause: Failed to
# fetch" -- the rest is uv's wording for the same failure, wrapped where CI's capture broke it)
SPLIT = """error: No solution found when resolving dependencies for split (markers: platform_machine == 'x86_64' and
sys_platform == 'linux'):
  Caused by: Because all versions of torch depend on
      pytorch-triton-rocm and pytorch-triton-rocm was not found in the package registry, we can conclude that all
      versions of torch cannot be used.
"""

WRAPPED = """error: Failed to download `flash-attn @
http://127.0.0.1:40211/flash/flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl`
  Caused by: Failed to fetch: `http://127.0.0.1:40211/flash/flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl`
  Caused by: HTTP status client error (404 File not found) for url
"""


def test_a_split_resolution_names_the_package_its_index_lacks():
    error = explain_failure(SPLIT, "Locking with uv")
    assert isinstance(error, MissingWheel)
    assert str(error).startswith("pytorch-triton-rocm (no version of it) is not on the index it comes from")


def test_a_wrapped_url_still_names_the_wheel():
    error = explain_failure(WRAPPED, "Locking with uv")
    assert isinstance(error, MissingWheel)
    assert "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl" in str(error)
