"""Chat templates: the Jinja environment they render in, and ``--chat-template``'s value read.

A chat template turns role/content messages into the prompt text a chat model was trained on.
The model's own comes with its tokenizer files (``tokenizer_config.json``'s ``chat_template`` or
``chat_template.jinja``); ``--chat-template`` replaces it for a model that has none or whose
template the operator wants otherwise. Torch-free, and imports jinja2 only when called: the
settings check a template at start with ``load_chat_template``.
"""

from __future__ import annotations

from pathlib import Path


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
