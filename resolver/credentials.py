"""Index credentials: used at run time, never written.

A mirror's URL may carry `user:token@` (`--index-url`, `--extra-index-url`, `--torch-index`,
$ENVTOOL_TORCH_INDEX_URL, $ENVTOOL_FLASH_ATTN_URL). envtool strips it from every URL before the URL goes into a
plan, a lock's pyproject.toml, an image, a log line or --json, and hands it to the one process that needs it:

1. uv gets it as `UV_INDEX_<NAME>_USERNAME` / `_PASSWORD` for the lock's named index whose (stripped) URL it
   belongs to (uv's own mechanism; `uv lock` and `uv sync` then never see it in a file);
2. envtool's own downloads (the wheelhouse, the nearest-wheel hint) send it as HTTP Basic to the same realm
   (scheme, host and port), as uv does;
3. with no credentials given, uv and requests read `~/.netrc` ($NETRC) themselves.

`redact` is the last guard: every error line the CLI prints passes through it.

4. a URL whose credentials stand without a scheme (`user:token@host/...`, `token@host/...`: urlsplit reads `user`
   as the scheme and the rest as a path, so nothing would be stripped) is refused in one line (BadInput, exit 2)
   by `split`/`strip`/`given`, naming where it came from ($ENVTOOL_TORCH_INDEX_URL, $ENVTOOL_FLASH_ATTN_URL or the
   option) with the credentials redacted; `redact` hides that form in free text too.
"""

from __future__ import annotations

import os
import re
from typing import Iterable
from urllib.parse import unquote, urlsplit, urlunsplit

_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s]*)@")
# credentials with no `scheme://` before them, at the start of a word (or after `https:/`): `user:secret@host`;
# `secret@host/...` (a host, then a path: not an e-mail address); `'secret@host` / `=secret@host` (a quoted value)
_BARE_USERINFO = re.compile(r"""(?P<pre>^|[\s'"=(,<\[]|:/?)(?P<userinfo>[^\s/@'"]+:[^\s/]*"""
                            r"""|[^\s/@'"][^\s/@]*(?=@[^\s/@'"]+/)|(?<=['"=])[^\s/@'"][^\s/@]*)@(?=[^\s/'"])""")


def _schemeless_secret(url: str) -> bool:
    """Credentials in a URL urlsplit gives no host: `user:token@host/...`, `token@host/...`, `https:/u:t@host`."""
    try:
        parts = urlsplit(url)
    except ValueError:  # an unbalanced [ in the host: judged by its text alone
        parts = None
    if parts is not None and (parts.netloc or parts.scheme == "file"):
        return False
    return "@" in url.split("?", 1)[0].split("#", 1)[0]


def _source(url: str) -> str:
    """Where a URL came from, for an error line: the environment variable that holds it, else the URL option."""
    # start-up: resolver.matrix imported only when this runs
    from .matrix import FLASH_ATTN_URL_ENV, TORCH_INDEX_ENV

    for name in (TORCH_INDEX_ENV, FLASH_ATTN_URL_ENV):
        if os.environ.get(name) == url:
            return f"${name}"
    return "an index URL"


def refuse_schemeless(url: str) -> None:
    """One line (BadInput, exit 2) for credentials in a URL without `scheme://` (see the module doc, 4)."""
    if _schemeless_secret(url):
        # start-up: resolver.errors imported only when this runs
        from .errors import BadInput

        shown = "***@" + url.split("?", 1)[0].split("#", 1)[0].rpartition("@")[2]
        raise BadInput(f"{_source(url)} {shown!r} carries credentials but no scheme: put https:// "
                       "(or http://) in front of it (the credentials are then used, never written)")


def split(url: str) -> tuple[str, tuple[str, str] | None]:
    """`https://user:token@host/path` -> (`https://host/path`, (user, token)); a URL without them unchanged.
    Credentials without a scheme are refused (BadInput)."""
    refuse_schemeless(url)
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), (unquote(user), unquote(password))


def strip(url: str | None) -> str | None:
    return None if url is None else split(url)[0]


def redact(text: str) -> str:
    """Any `scheme://user:secret@` in text becomes `scheme://***@`, and a bare `user:secret@host` `***@host`."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}***@", text)
    return _BARE_USERINFO.sub(lambda m: f"{m['pre']}***@", text)


def _realm(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or ""), parts.port


def given(urls: Iterable[str | None]) -> dict[str, tuple[str, str]]:
    """The credentials carried by `urls` and by $ENVTOOL_TORCH_INDEX_URL / $ENVTOOL_FLASH_ATTN_URL, by stripped URL
    ({variant}/{version} templates stay templates)."""
    # start-up: resolver.matrix imported only when this runs
    from .matrix import FLASH_ATTN_URL_ENV, TORCH_INDEX_ENV

    found = {}
    for url in [*urls, os.environ.get(TORCH_INDEX_ENV), os.environ.get(FLASH_ATTN_URL_ENV)]:
        if url:
            clean, secret = split(url)
            if secret:
                found[clean] = secret
    return found


def _matches(template: str, url: str) -> bool:
    pattern = re.escape(template.rstrip("/"))
    pattern = re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", pattern)
    return re.fullmatch(pattern, url.rstrip("/")) is not None


def uv_index_env(indexes: dict[str, str], secrets: dict[str, tuple[str, str]]) -> dict[str, str]:
    """`UV_INDEX_<NAME>_USERNAME/_PASSWORD` for each named index (name -> stripped URL) that a given credential
    belongs to (the same URL, or the same template)."""
    env = {}
    for name, url in indexes.items():
        secret = next((s for template, s in secrets.items() if _matches(template, url)), None)
        if secret:
            key = re.sub(r"[^A-Z0-9]", "_", name.upper())
            env[f"UV_INDEX_{key}_USERNAME"], env[f"UV_INDEX_{key}_PASSWORD"] = secret
    return env


def lock_indexes(env_dir) -> dict[str, str]:
    """The named indexes of a lock directory's pyproject.toml: name -> URL."""
    # start-up: tomllib imported only when this runs
    import tomllib

    try:
        data = tomllib.loads((env_dir / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    return {i["name"]: i["url"] for i in data.get("tool", {}).get("uv", {}).get("index", []) if "name" in i}


def auth_for(url: str, secrets: dict[str, tuple[str, str]]) -> tuple[str, str] | None:
    """The credentials to send with a download from `url`: those given for an index on the same realm (scheme,
    host, port), as uv does; None lets requests read ~/.netrc."""
    realm = _realm(url)
    return next((s for template, s in secrets.items() if _realm(template.replace("{", "").replace("}", "")) == realm),
                None)
