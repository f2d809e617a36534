"""Credentials in malformed index URLs (issue 33, item 9): a scheme-less `user:TOKEN@host/...` (or `TOKEN@host/...`)
in $ENVTOOL_TORCH_INDEX_URL, $ENVTOOL_FLASH_ATTN_URL or --index-url is refused in one line (exit 2) that never shows
the token; the token never reaches `resolve --json` (and so never a plan, a lock or an image label). URLs are
generated (hypothesis); the commands are envtool's own (its typer app in this process, and once as a subprocess).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from resolver import credentials
from resolver.cli import app
from resolver.errors import BadInput

from .conftest import run_envtool

UNRESERVED = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~"
SUB_DELIMS = "!$&'()*+,;="
users = st.text(UNRESERVED, min_size=1, max_size=12)
# a token that cannot occur in the rest of the line by chance: a fixed prefix, then what a token may hold
tokens = st.text(UNRESERVED + SUB_DELIMS + "%:", min_size=0, max_size=24).map(lambda t: "TOKxq" + t)
hosts = st.builds(lambda name, tld, port: f"{name}.{tld}{port}", st.text("abcdefghijklmnopqrstuvwxyz0123456789-",
                  min_size=1, max_size=12), st.sampled_from(["com", "example", "co.uk", "internal"]),
                  st.sampled_from(["", ":8080", ":443"]))
paths = st.lists(st.text(UNRESERVED, min_size=1, max_size=8), max_size=3).map(lambda p: "/".join(p))


@st.composite
def schemeless(draw) -> tuple[str, str]:
    user, token, host, path = draw(users), draw(tokens), draw(hosts), draw(paths)
    form = draw(st.sampled_from(["{u}:{t}@{h}/{p}", "{t}@{h}/{p}", "{u}:{t}@{h}", "https:/{u}:{t}@{h}/{p}",
                                 "https:{u}:{t}@{h}/{p}", "{u}:{t}@{h}/whl/{{variant}}"]))
    return form.format(u=user, t=token, h=host, p=path), token


@given(schemeless())
@settings(max_examples=100, deadline=None)
def test_a_schemeless_url_with_credentials_is_refused_without_its_token(case):
    url, token = case
    with pytest.raises(BadInput) as refused:
        credentials.strip(url)
    line = str(refused.value)
    assert token not in line and "\n" not in line and "carries credentials but no scheme" in line
    assert token not in credentials.redact(f"envtool: error: --index-url {url!r}: give an http(s):// URL")
    assert token not in credentials.redact(f"index {url} failed")


@given(users, tokens, hosts, paths, st.sampled_from(["https", "http"]))
@settings(max_examples=100, deadline=None)
def test_a_url_with_its_scheme_still_carries_credentials_to_uv_and_never_into_text(user, token, host, path, scheme):
    url = f"{scheme}://{user}:{token}@{host}/{path}"
    clean, secret = credentials.split(url)
    assert clean == f"{scheme}://{host}/{path}" and secret is not None and token not in clean
    assert token not in credentials.redact(f"error: {url} and again '{url}'")


@given(st.text(min_size=0, max_size=60))
@settings(max_examples=100, deadline=None)
def test_text_without_credentials_passes_redact_unchanged_unless_it_looks_like_them(text):
    redacted = credentials.redact(text)
    assert redacted == text or "***@" in redacted


@pytest.mark.slow
@given(schemeless())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_resolve_json_refuses_a_schemeless_torch_index_with_credentials(monkeypatch, case):
    url, token = case
    monkeypatch.setenv("ENVTOOL_TORCH_INDEX_URL", url)
    result = CliRunner().invoke(app, ["resolve", "--gpu", "H100", "--json"])
    output = (result.stdout or "") + (result.stderr or "")
    assert result.exit_code == 2, output
    assert token not in output and output.count("\n") == 1, output
    assert "$ENVTOOL_TORCH_INDEX_URL '***@" in output


@pytest.mark.slow
def test_envtool_resolve_and_lock_never_print_a_schemeless_token(tmp_path):
    url = "user:TOKEN7f3a@mirror.example/whl/{variant}"
    refused = run_envtool("resolve", "--gpu", "H100", "--json", ENVTOOL_TORCH_INDEX_URL=url, ENVTOOL_PLAN=None)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr == ("envtool: error: $ENVTOOL_TORCH_INDEX_URL '***@mirror.example/whl/{variant}' carries "
                              "credentials but no scheme: put https:// (or http://) in front of it (the credentials "
                              "are then used, never written)\n")
    ok = run_envtool("resolve", "--gpu", "H100", "--json", ENVTOOL_PLAN=None,
                     ENVTOOL_TORCH_INDEX_URL="https://user:TOKEN7f3a@mirror.example/whl/{variant}")
    assert ok.returncode == 0 and "TOKEN7f3a" not in ok.stdout + ok.stderr
    assert json.loads(ok.stdout)  # the plan, stripped
    lock = run_envtool("lock", "--gpu", "H100", "--out", str(tmp_path / "env"), "--index-url",
                       "user:TOKEN7f3a@mirror.example/simple", ENVTOOL_PLAN=None)
    assert lock.returncode == 2 and "TOKEN7f3a" not in lock.stdout + lock.stderr
    assert len(lock.stderr.strip().splitlines()) == 1 and "***@mirror.example/simple" in lock.stderr
    assert not (tmp_path / "env").exists()
