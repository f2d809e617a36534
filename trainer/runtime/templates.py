"""A chat template rendered under a time budget. Templates are user text (a model's chat_template.jinja, the config's
chat_template_jinja): one with nested `range(100000)` loops would hang whatever renders it -- data preparation (with
its lock held), the final save, merge-lora, export and chat-check -- printing nothing. Here each render has
TEMPLATE_SECONDS, then ConfigError names the tokenizer and the keys to fix."""

from __future__ import annotations

from trainer.errors import ConfigError

TEMPLATE_SECONDS = 10.0  # rendering one short conversation: real templates take milliseconds


class _Expired(BaseException):  # not an Exception: jinja and transformers catch those and would carry on
    pass


def render(tokenizer, messages, **kwargs):
    """tokenizer.apply_chat_template under TEMPLATE_SECONDS (see the module's docstring); past it, ConfigError
    naming the tokenizer's directory. The budget is a SIGALRM timer, so it holds in a process's main thread (where
    every command renders, and each of datasets' map workers); elsewhere the template renders unbounded."""
    # start-up: signal, threading imported only when this runs
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return tokenizer.apply_chat_template(messages, **kwargs)

    def expired(signum, frame):
        raise _Expired()

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, TEMPLATE_SECONDS)
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except _Expired:
        where = getattr(tokenizer, "name_or_path", None) or "the tokenizer"
        raise ConfigError(f"{where}: the chat template did not finish rendering a {len(messages)}-message "
                          f"conversation in {TEMPLATE_SECONDS:g} s (a loop without bound, e.g. nested range()?): fix "
                          "chat_template.jinja, or the config's chat_template / chat_template_jinja") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
