"""Before anything is read from the Hugging Face Hub: one short probe, so a run with no hub access fails (or goes
offline) in seconds instead of a minute of retries.

huggingface_hub retries a refused or timed-out connection five times with growing waits (about 55 s) for every
file transformers asks for, and only then does transformers say it could not connect. So, before the tokenizer and
model load (``python -m trainer train|preprocess|evaluate``): when the config names anything on the Hub (a
``base_model``, ``tokenizer_config`` or ``lora_model_dir`` that is not a local directory, a hub dataset) and
HF_HUB_OFFLINE is not set, one request to the Hub's endpoint (HF_ENDPOINT) with a short timeout and no retries:

- it answers (any HTTP status): nothing changes;
- it does not, and every model the run names is in the local Hugging Face cache: the run goes offline
  (HF_HUB_OFFLINE, as if the user had set it) with a note, and reads the cache;
- it does not, and a model is not cached: ConfigError (exit 2) in one line naming the model and the endpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainer.config.load import looks_local
from trainer.errors import ConfigError

PROBE_TIMEOUT_S = 5.0
TRUE = ("1", "true", "yes", "on")


def offline() -> bool:
    return any(os.environ.get(name, "").lower() in TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_models(cfg) -> list[tuple[str, str, str]]:
    """(config key, hub id, a file every such repository holds) for each model-like thing the config reads from
    the Hub."""
    found = []
    for key, marker in (("base_model", "config.json"), ("tokenizer_config", "tokenizer_config.json"),
                        ("lora_model_dir", "adapter_config.json")):
        value = getattr(cfg, key, None)
        if value and not Path(value).expanduser().exists() and not looks_local(value) and value.count("/") == 1:
            found.append((key, value, marker))
    return found


def hub_datasets(cfg) -> list[str]:
    groups = [*(getattr(cfg, "datasets", None) or []), *(getattr(cfg, "pretraining_dataset", None) or [])]
    return [ds.path for ds in groups if ds.path and not looks_local(ds.path)]  # (no path: local data_files)


def reachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when `url` answers at all (any HTTP status), else why not, in a few words. One request, no retries."""
    try:
        head(url, timeout=timeout)
        return None
    except OSError as err:
        return str(err)


def head(url: str, headers: dict[str, str] | None = None, timeout: float = PROBE_TIMEOUT_S):
    """One HEAD request with the standard library (no redirect followed: a redirect is an answer), no retries.
    Returns None for a 1xx-3xx answer, the urllib HTTPError for a 4xx/5xx one; raises OSError with why not in a few
    words when nothing answers. (urllib, not httpx or requests: the trainer's declared dependencies do not include
    an HTTP client, and huggingface_hub's changes from one release to the next.)"""
    # start-up: urllib loads only when a probe runs
    import urllib.error
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):  # a redirect (to the CDN) is the Hub's "here it is"
            return None

    request = urllib.request.Request(url, method="HEAD", headers=headers or {})
    try:
        urllib.request.build_opener(NoRedirect).open(request, timeout=timeout).close()
        return None
    except urllib.error.HTTPError as err:
        return err if err.code >= 400 else None
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise OSError(f"no answer in {timeout:g}s" if isinstance(reason, TimeoutError)
                      else why_not(str(reason) or type(reason).__name__)) from None


def why_not(text: str) -> str:
    """A connection error's text in a few words (connection refused, unknown host), else its first line."""
    for needle, why in (("refused", "connection refused"), ("Name or service not known", "unknown host"),
                        ("nodename nor servname", "unknown host"), ("Temporary failure in name resolution",
                                                                     "unknown host")):
        if needle in text:
            return why
    return text.splitlines()[0][:120] if text else "no answer"


def cached(repo: str, filename: str, revision: str | None) -> bool:
    # heavy: huggingface_hub loads only when this runs
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo, filename, revision=revision), str)
    except Exception:  # a malformed repo id: the load itself says so
        return False


def go_offline() -> None:
    """HF_HUB_OFFLINE for this process and its children (data loader workers, datasets' processes)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    # heavy: huggingface_hub loads only when this runs
    import huggingface_hub.constants as constants

    constants.HF_HUB_OFFLINE = True  # read at import time: is_offline_mode() returns this


def ensure(cfg, log=print) -> None:
    """Probe the Hub once when the config reads from it (see the module's docstring). Raises ConfigError when a
    model is neither here nor reachable."""
    models, datasets = hub_models(cfg), hub_datasets(cfg)
    if not (models or datasets) or offline():
        return
    why = reachable(endpoint())
    if why is None:
        return
    revision = getattr(cfg, "revision_of_model", None)
    for key, repo, marker in models:
        if not cached(repo, marker, revision if key == "base_model" else None):
            raise ConfigError(f"{key}: {repo} is not on this machine (no such directory, not in the Hugging Face cache "
                              f"{cache_dir()}) and the Hugging Face Hub at {endpoint()} does not answer ({why}): "
                              "give a local directory, download it where the Hub is reachable, or fix the network "
                              "(HF_ENDPOINT, a proxy)")
    go_offline()
    what = ", ".join([repo for _, repo, _ in models] + datasets)
    log(f"note: the Hugging Face Hub at {endpoint()} does not answer ({why}): offline (HF_HUB_OFFLINE=1), reading "
        f"{what} from the local cache")


def cache_dir() -> str:
    # heavy: huggingface_hub loads only when this runs
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
