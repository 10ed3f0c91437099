"""The chat template of a run folder or pretrained name (``moelab serve``, ``moelab convert
--to gguf``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moelab.errors import InvalidValueError

if TYPE_CHECKING:
    from moelab.serve.chat import ChatTemplate


def chat_template_for(run: Path) -> ChatTemplate:
    """The run folder's chat template; else, for a pretrained name (``smollm2``) or a run
    upcycled from one (``upcycle.json`` names its ``source``), the template stored in that
    model's GGUF file; else the plain role-prefixed template."""
    from moelab.interop.pretrained import PRETRAINED, pretrained_available, pretrained_path
    from moelab.serve.chat import ChatTemplate, load_chat_template
    from moelab.utils.jsonfile import read_json

    folder = run if run.is_dir() else None
    template = load_chat_template(folder)
    if not template.is_plain:
        return template
    source = str(run) if folder is None else None
    if folder is not None and (folder / "upcycle.json").is_file():
        source = read_json(folder / "upcycle.json", InvalidValueError).get("source")
    if (
        source not in PRETRAINED
        or PRETRAINED[source].kind != "causal_lm"
        or not pretrained_available(source)
    ):
        return template
    from moelab.interop.gguf import read_gguf_metadata

    meta = read_gguf_metadata(pretrained_path(source))
    jinja = meta.get("tokenizer.chat_template")
    if not isinstance(jinja, str):
        return template
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def special(key: str) -> str:
        i = meta.get(key)
        return str(tokens[i]) if isinstance(i, int) and 0 <= i < len(tokens) else ""

    return ChatTemplate(
        jinja,
        bos_token=special("tokenizer.ggml.bos_token_id"),
        eos_token=special("tokenizer.ggml.eos_token_id"),
    )
