"""The MESA recipe: build the MoE model, select experts, align, evaluate (one arm, one seed).

Per run: the base model is upcycled with the seed's random router rows (or an MoE folder is
used as it is), adapters are added, stage 1 selects experts (:mod:`.select`), stage 2 trains
(:mod:`.train`), and :mod:`.evaluate` measures it against the model before training. The
data, the cached hidden states and the base model's responses are built once per source and
shared by all arms and seeds (the lower blocks are frozen and upcycling preserves the
function, so they do not depend on the seed).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import torch

from moelab.core.config import RouterConfig
from moelab.data.tokenizer import Tokenizer, load_tokenizer
from moelab.errors import InvalidValueError
from moelab.interop.pretrained import available_pretrained, load_pretrained
from moelab.methods.alignment.config import AlignConfig
from moelab.methods.alignment.data import AlignData, Prompts, build_data, load_prompts
from moelab.methods.alignment.evaluate import evaluate_alignment
from moelab.methods.alignment.select import LayerSelection, select_experts
from moelab.methods.alignment.train import align_model
from moelab.models.io import load_model
from moelab.models.lora import add_expert_lora
from moelab.models.transformer import MoETransformer
from moelab.train.upcycle import upcycle


def load_source(source: str, max_seq_len: int) -> tuple[MoETransformer, Tokenizer]:
    """``(model in eval mode, tokenizer)`` of a pretrained causal LM name or a moelab model
    folder with its tokenizer.

    Raises:
        InvalidValueError: neither a pretrained name nor a folder.
    """
    if source.lower() in available_pretrained("causal_lm"):
        return load_pretrained(source, max_seq_len=max_seq_len, kind="causal_lm")
    folder = Path(source)
    if not folder.is_dir():
        raise InvalidValueError(
            f"source: {source!r} is neither a pretrained model "
            f"({', '.join(available_pretrained('causal_lm'))}) nor a model folder"
        )
    return load_model(folder).eval(), load_tokenizer(folder)


def moe_model(base: MoETransformer, cfg: AlignConfig, seed: int) -> tuple[MoETransformer, int]:
    """``(MoE model, first MoE block)``: ``base`` upcycled (dense) or copied (MoE).

    Raises:
        InvalidValueError: an MoE base whose layers already carry adapters.
    """
    if base.cfg.moe is None:
        router = RouterConfig(norm_topk_prob=True, expert_bias=True)
        moe = upcycle(
            base, cfg.num_experts, cfg.top_k, router_init="random", seed=seed,
            router=router, first_dense_layers=cfg.first_moe_layer,
        )  # fmt: skip
        return moe.eval(), cfg.first_moe_layer
    if base.cfg.moe.experts.lora_rank:
        raise InvalidValueError("source: already has expert LoRA adapters; merge them first")
    first = min(i for i, b in enumerate(base.blocks) if b.is_moe)
    return copy.deepcopy(base).eval(), first


@dataclasses.dataclass
class Aligned:
    """One aligned run: the model (adapters still separate), the one before alignment, the
    tokenizer, the stage-1 selection per MoE block and the training statistics."""

    model: MoETransformer
    base: MoETransformer
    tokenizer: Tokenizer
    selection: dict[int, LayerSelection]
    train_stats: dict[str, float]
    data: AlignData


class MESARecipe:
    """Runs one arm of :class:`AlignConfig` for one seed (``moelab.methods.runner``).

    Args:
        prompts: the prompt sets (None: :func:`load_prompts`, the installed packages).
    """

    name = "mesa"

    def __init__(self, prompts: Prompts | None = None) -> None:
        self._prompts = prompts
        self._shared: dict[tuple, tuple[MoETransformer, Tokenizer, AlignData]] = {}
        self.timings: dict[str, float] = {}

    def _shared_data(self, cfg: AlignConfig, seed: int):
        fields = dataclasses.asdict(cfg)
        for name in (
            "arm",
            "w",
            "epsilon",
            "cost_alpha",
            "rho",
            "gamma",
            "lora_lr",
            "router_lr",
            "epochs",
            "batch_size",
            "attack_m",
        ):
            fields.pop(name)
        key = tuple(sorted(fields.items()))
        if key not in self._shared:
            t0 = time.perf_counter()
            base, tok = load_source(cfg.source, cfg.max_seq_len)
            moe, start = moe_model(base, cfg, seed)
            prompts = self._prompts if self._prompts is not None else load_prompts()
            with torch.no_grad():
                data = build_data(moe, tok, prompts, cfg, start)
            self._shared[key] = (base, tok, data)
            self.timings["shared_data_seconds"] = time.perf_counter() - t0
        return self._shared[key]

    def align(self, cfg: AlignConfig, seed: int) -> Aligned:
        """Stage 1 and stage 2 of ``cfg.arm`` with ``seed`` (router rows, adapters, order)."""
        base_src, tok, data = self._shared_data(cfg, seed)
        torch.manual_seed(seed)
        base, _ = moe_model(base_src, cfg, seed)
        model = add_expert_lora(base, cfg.lora_rank, cfg.lora_alpha).eval()
        selection = select_experts(model, data.stat, data.start, cfg)
        stats = align_model(model, data, selection, cfg, seed)
        return Aligned(model, base, tok, selection, stats, data)

    def run(self, config: AlignConfig, seed: int) -> dict[str, float]:
        run = self.align(config, seed)
        t0 = time.perf_counter()
        metrics = evaluate_alignment(run.model, run.base, run.tokenizer, run.data, config)
        metrics.update(run.train_stats)
        metrics["eval_seconds"] = time.perf_counter() - t0
        return metrics
