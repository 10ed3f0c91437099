"""Chat templates: the model folder's Jinja template, or the plain role-prefixed one."""

from __future__ import annotations

import json

import pytest

from moelab.serve.chat import ChatTemplate, load_chat_template

MSGS = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_plain_template_and_its_stop():
    t = load_chat_template(None)
    assert t.is_plain and t.default_stop == ["\nuser:"]
    assert t.render(MSGS) == "system: S\nuser: Hi\nassistant:"


def test_folder_templates(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"})
    )
    t = load_chat_template(tmp_path)
    want = (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not t.is_plain and t.default_stop == [] and t.render(MSGS) == want
    (tmp_path / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}!")
    assert load_chat_template(tmp_path).render(MSGS) == "Hi!"  # the .jinja file wins


def test_bad_templates_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        t.render(MSGS)
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_chat_template(tmp_path)
    # the sandbox refuses attribute access to Python internals
    with pytest.raises(ValueError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(MSGS)
