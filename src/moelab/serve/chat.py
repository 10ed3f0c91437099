"""Chat prompts: the model's own chat template when its folder has one, else a plain one.

A Hugging Face chat template is a Jinja template over ``messages`` (``[{role, content}]``)
with ``add_generation_prompt``, ``bos_token`` and ``eos_token``; it is read from the model
folder's ``chat_template.jinja`` or ``tokenizer_config.json`` (``"chat_template"``) and
rendered in Jinja's immutable sandbox, as ``transformers`` does (``trim_blocks`` and
``lstrip_blocks`` on, ``raise_exception`` available to the template).

Our choice for models without a template (moelab's own byte/BPE runs): ``"<role>: <content>\\n"``
per message, then ``"assistant:"``; generation stops at ``"\\nuser:"`` so the model does not
write the user's next turn.
"""

from __future__ import annotations

import os
from pathlib import Path

from moelab.errors import InvalidValueError
from moelab.utils.jsonfile import read_json

PLAIN_STOP = "\nuser:"
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
"""The plain template as Jinja (what a GGUF file carries for a model without a template)."""


class ChatTemplate:
    """Renders chat messages to a prompt string.

    Args:
        template: Jinja source, or None for the plain role-prefixed template.
        bos_token, eos_token: strings the template may reference.

    Raises:
        ValueError: a template that does not compile (naming the Jinja error).
    """

    def __init__(
        self, template: str | None = None, *, bos_token: str = "", eos_token: str = ""
    ) -> None:
        self.source = template
        self.bos_token, self.eos_token = bos_token, eos_token
        self._compiled = None
        if template is not None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise InvalidValueError(f"chat template: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            try:
                self._compiled = env.from_string(template)
            except TemplateError as e:
                raise InvalidValueError(f"chat template: does not compile ({e})") from e

    @property
    def is_plain(self) -> bool:
        return self._compiled is None

    @property
    def jinja(self) -> str:
        """The template's Jinja source (:data:`PLAIN_TEMPLATE` for the plain one)."""
        return PLAIN_TEMPLATE if self.source is None else self.source

    @property
    def default_stop(self) -> list[str]:
        """Stop strings every chat request gets (the plain template's next-turn marker)."""
        return [PLAIN_STOP] if self.is_plain else []

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt for ``messages`` (each ``{"role", "content"}``), ending where the
        assistant's reply starts.

        Raises:
            ValueError: the template rejected the messages (``raise_exception``) or failed.
        """
        if self._compiled is None:
            turns = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return turns + "assistant:"
        from jinja2 import TemplateError

        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as e:
            raise InvalidValueError(f"chat template: failed to render ({e})") from e


def load_chat_template(folder: str | os.PathLike[str] | None) -> ChatTemplate:
    """The chat template stored with a model folder, or the plain template when it has none
    (or ``folder`` is None).

    Raises:
        ValueError: a stored template that is unreadable or does not compile (naming the file).
    """
    if folder is None or not Path(folder).is_dir():
        return ChatTemplate()
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    config = folder / "tokenizer_config.json"
    source, specials = None, {}
    if config.is_file():
        cfg = read_json(config, InvalidValueError)
        if isinstance(cfg, dict):
            if isinstance(cfg.get("chat_template"), str):
                source = cfg["chat_template"]
            for key in ("bos_token", "eos_token"):
                if isinstance(cfg.get(key), str):
                    specials[key] = cfg[key]
    if jinja.is_file():
        try:
            source = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidValueError(f"{jinja}: unreadable ({e})") from e
    try:
        return ChatTemplate(source, **specials)
    except ValueError as e:
        raise InvalidValueError(f"{folder}: {e}") from e
