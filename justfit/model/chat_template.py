"""Chat templates: whether a model has one (base models do not), and supplying one from
a Jinja file. The CLI and the server decide "chat or raw text" with the same function."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# What a supplied template must be able to render before it is used.
SAMPLE = [{"role": "user", "content": "Hello"}]

# Used when a model ships no chat template (base models).
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] + '\n\n' }}"
    "{% elif m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\n' }}"
    "{% else %}{{ 'Assistant: ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """A chat template file that cannot be read or rendered."""


def has_chat_template(tokenizer: Any) -> bool:
    """True when the tokenizer carries a chat template (or mlx-lm's own renderer)."""
    return bool(getattr(tokenizer, "chat_template", None) or getattr(tokenizer, "has_chat_template", False))


def read_chat_template(path: str | Path) -> str:
    """The text of a Jinja chat template file; a clear error when it cannot be read."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"cannot read chat template {path}: {_reason(e)}") from None
    if not text.strip():
        raise ChatTemplateError(f"chat template {path} is empty")
    return text


def check_chat_template(tokenizer: Any, template: str, source: str = "the chat template") -> None:
    """Render a one-message conversation with `template`; a clear error (with the
    Jinja line) when it does not compile or render, or leaves the message out."""
    try:
        text = tokenizer.apply_chat_template(SAMPLE, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # jinja2's syntax, undefined and raise_exception() errors
        line = getattr(e, "lineno", None)
        where = f" (line {line})" if line else ""
        raise ChatTemplateError(f"{source} is not a usable Jinja chat template{where}: {_reason(e)}") from None
    if not isinstance(text, str) or SAMPLE[0]["content"] not in text:
        raise ChatTemplateError(f"{source} does not render the messages it is given")


def use_chat_template(tokenizer: Any, template: str, source: str = "the chat template") -> None:
    """Check `template` (see check_chat_template) and make it the tokenizer's, in place
    of the model's own if it has one."""
    check_chat_template(tokenizer, template, source)
    tokenizer.chat_template = template  # mlx-lm's wrapper forwards it to the HF tokenizer


def render_chat(tokenizer: Any, messages: list[dict], tools: list | None = None) -> list[int]:
    """Token ids of `messages` (and `tools`) rendered for a reply to follow, with
    FALLBACK_TEMPLATE when the tokenizer has no template of its own."""
    kwargs: dict[str, Any] = {"add_generation_prompt": True}
    if tools:
        kwargs["tools"] = tools
    if not getattr(tokenizer, "chat_template", None):
        kwargs["chat_template"] = FALLBACK_TEMPLATE
    out = tokenizer.apply_chat_template(messages, **kwargs)
    return list(out["input_ids"] if isinstance(out, dict) else out)


def _reason(e: BaseException) -> str:
    text = e.strerror if isinstance(e, OSError) and e.strerror else getattr(e, "message", None) or str(e)
    text = " ".join(str(text).split())
    return text or type(e).__name__
