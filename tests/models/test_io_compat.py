"""Model folders written before the USMoE defaults changed still load."""

from __future__ import annotations

import json

from moelab.models import ModelConfig, MoETransformer, load_config, save_model


def test_old_usmoe_defaults_of_a_token_choice_router_are_ignored(tmp_path):
    save_model(MoETransformer(ModelConfig.tiny(vocab_size=32, max_seq_len=16)), tmp_path)
    path = tmp_path / "config.json"
    obj = json.loads(path.read_text())
    router = obj["model"]["moe"]["router"]
    router.update(selection_scope="sequence", usmoe_weight_norm="none")  # the old defaults
    path.write_text(json.dumps(obj))
    cfg = load_config(tmp_path)
    assert cfg.moe.router.kind == "token_choice"
    assert cfg.moe.router.selection_scope == "position"
    router.update(selection_scope="batch")  # not an old default: still refused
    path.write_text(json.dumps(obj))
    try:
        load_config(tmp_path)
    except ValueError as e:
        assert "selection_scope" in str(e)
    else:
        raise AssertionError("a non-default USMoE field on a token-choice router must fail")
