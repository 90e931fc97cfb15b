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


# Appended to the final message under continue_final_message, so the rendering is cut where the
# message's text ends (a search for the text itself can match the end-of-turn marker after it, as
# "<" does in "<|im_end|>"). A template may trim the space after it.
CONTINUE_MARK = "PAGEWIRE_CONTINUE_FINAL_MESSAGE "


def mark_final_message(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation to render under ``continue_final_message``: its final message ends with
    ``CONTINUE_MARK``."""
    *head, final = messages
    return [*head, {**final, "content": final["content"] + CONTINUE_MARK}]


def cut_at_mark(rendered: str, final_content: str) -> str:
    """A conversation rendered from ``mark_final_message`` up to the end of its final message's
    text: what the model continues. Whitespace after the text stays where the template kept the
    mark's own; ``ValueError`` when the template changed the text or dropped the mark."""
    mark = CONTINUE_MARK.strip()
    at = rendered.rfind(mark)
    if at < 0 or final_content.strip() not in rendered[:at]:
        raise ValueError("continue_final_message: the chat template changes the final message's text, "
                         "so it cannot be continued")
    if rendered.startswith(CONTINUE_MARK, at):
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing whitespace


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
