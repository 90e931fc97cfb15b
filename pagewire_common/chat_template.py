"""Chat templates: the Jinja environment they render in, and ``--chat-template``'s value read.

A chat template turns role/content messages into the prompt text a chat model was trained on.
The model's own comes with its tokenizer files (``tokenizer_config.json``'s ``chat_template`` or
``chat_template.jinja``); ``--chat-template`` replaces it for a model that has none or whose
template the operator wants otherwise. Torch-free, and imports jinja2 only when called: the
settings check a template at start with ``load_chat_template``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How a conversation ends when rendered. ``add_generation_prompt``: with the template's
    opening of the assistant's turn, so the model answers (the usual). ``continue_final_message``:
    inside the final message, cut after its text with no end of turn, so the model goes on with it
    (an answer begun for it). ``ValueError`` for both at once, as vLLM answers."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: "
                             "set add_generation_prompt to false to continue the final message")


def cut_after_final_message(rendered: str, messages: list[dict[str, str]]) -> str:
    """``rendered`` (a conversation rendered without the generation prompt) up to the end of its
    final message's text: what the model continues under ``continue_final_message``. The text is
    found as the template wrote it, its surrounding whitespace kept only where the template kept
    it; ``ValueError`` when the template changed it beyond that, or it is empty."""
    content = messages[-1]["content"]
    core = content.strip()
    if not core:
        raise ValueError("continue_final_message needs a final message with text to continue")
    start = rendered.rfind(core)
    if start < 0:
        raise ValueError("continue_final_message: the chat template changes the final message's text, "
                         "so it cannot be continued")
    # leading whitespace is trimmed or not by the template before ``core``; trailing whitespace is
    # kept when the template kept it
    with_tail = content.lstrip()
    if rendered.startswith(with_tail, start):
        return rendered[: start + len(with_tail)]
    return rendered[: start + len(core)]


def _raise_template_error(message: str):
    raise ValueError(f"chat template error: {message}")


def compile_chat_template(text: str):
    """The compiled template (``jinja2.Template``) in the sandbox every chat template renders in;
    ``ValueError`` naming the line for a template that does not parse."""
    import jinja2
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not parse: {e.message} (line {e.lineno})") from None


def load_chat_template(value: str) -> str:
    """The template text of ``--chat-template``: a file's contents, or ``value`` itself when it is
    a template (it holds a ``{`` or a line break) rather than a path. ``ValueError`` when the file
    is missing or unreadable, or the template does not parse."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the chat template {value}: {e}") from None
    elif any(c in value for c in "{}\n"):
        text = value
    elif path.exists():
        raise ValueError(f"the chat template {value} is not a file")
    else:
        raise ValueError(f"no chat template file {value} (give a Jinja file's path, or the template itself)")
    if not text.strip():
        raise ValueError(f"the chat template {value} is empty")
    compile_chat_template(text)
    return text
