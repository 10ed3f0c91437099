"""``moelab upcycle``: upcycle a dense model (pretrained name or model folder) into a run folder.

The written folder holds what ``moelab train --init-from FOLDER`` reads:

    config.json, model.safetensors, manifest.json   (moelab.models.save_model)
    tokenizer_meta.json, tokenizer.json              (Tokenizer.save)
    upcycle.json                                      provenance and the measured check

The folder is assembled in a temporary sibling folder and renamed into place, so ``out`` is
either absent, its previous content, or the complete new folder — never half written.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch

from moelab.cli._app import Opt, app, console, fail, guarded
from moelab.cli._ranges import SEED, Range
from moelab.data.fingerprint import tokenizer_files
from moelab.errors import InvalidValueError
from moelab.interop.pretrained import (
    PRETRAINED,
    PretrainedNotInstalledError,
    available_pretrained,
    load_pretrained,
)
from moelab.models.config import ModelConfig
from moelab.models.dense_twin import count_params
from moelab.models.io import CheckpointError, load_model, save_model
from moelab.models.transformer import MoETransformer
from moelab.train.upcycle import (
    ROUTER_INITS,
    max_logit_diff,
    selects_complete_copies,
    upcycle,
    upcycle_spec,
)
from moelab.utils.atomic import atomic_write_json, write_folder_atomically
from moelab.utils.fields import check_seed
from moelab.utils.outdir import check_output_folder

UPCYCLE_FILE = "upcycle.json"
PROBE_TEXT = "The capital of France is Paris. Mixture-of-experts models route each token."
"""Text whose tokens the written model is checked on (dense vs upcycled logits)."""


@dataclass
class UpcycleResult:
    """What :func:`upcycle_command` did.

    Attributes:
        out: the run folder written.
        source: the source as given.
        config: the upcycled model's config.
        num_experts, top_k: routed experts (E·G) and active experts (k·G) per MoE layer.
        granularity: G.
        params: ``count_params`` of the upcycled model (``total``, ``active_per_token``, ...).
        dense_params: total parameters of the dense source.
        max_abs_logit_diff: ``max |logits_moe − logits_dense|`` on the probe tokens.
        max_abs_logit: ``max |logits_dense|`` on the probe tokens (scale of the above).
        complete_copies: every token picked whole copies in every layer on the probe.
        probe_tokens: tokens in the probe.
        seconds: wall time of the whole command.
    """

    out: Path
    source: str
    config: ModelConfig
    num_experts: int
    top_k: int
    granularity: int
    params: dict[str, int] = field(default_factory=dict)
    dense_params: int = 0
    max_abs_logit_diff: float = 0.0
    max_abs_logit: float = 0.0
    complete_copies: bool = True
    probe_tokens: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (what ``upcycle.json`` holds, minus the config)."""
        return {
            "out": str(self.out),
            "source": self.source,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "granularity": self.granularity,
            "params": self.params,
            "dense_params": self.dense_params,
            "max_abs_logit_diff": self.max_abs_logit_diff,
            "max_abs_logit": self.max_abs_logit,
            "complete_copies": self.complete_copies,
            "probe_tokens": self.probe_tokens,
            "seconds": self.seconds,
        }


def load_dense_source(source: str | os.PathLike[str]) -> tuple[MoETransformer, Any]:
    """``(dense model, tokenizer)`` of a pretrained name or a moelab model/run folder.

    Raises:
        ValueError: naming ``source`` — unknown name and not a folder, a folder without a
            model or tokenizer, or a model that already has MoE layers.
        PretrainedNotInstalledError: the named model's package is missing (pip commands).
    """
    from moelab.data.tokenizer import load_tokenizer

    name = str(source)
    if name.lower() in PRETRAINED:
        model, tok = load_pretrained(name, kind="causal_lm")
    else:
        folder = Path(source)
        if not folder.is_dir():
            raise InvalidValueError(
                f"source: {name!r} is neither a pretrained model "
                f"({', '.join(available_pretrained('causal_lm'))}) nor an existing model folder"
            )
        try:
            model = load_model(folder)
        except CheckpointError as e:
            raise InvalidValueError(f"source: {folder} holds no loadable moelab model ({e})") from e
        try:
            tok = load_tokenizer(folder)
        except ValueError as e:
            raise InvalidValueError(f"source: {folder} holds no tokenizer ({e})") from e
    if model.cfg.moe is not None:
        raise InvalidValueError(
            f"source: {name!r} is already an MoE model; upcycling needs a dense one"
        )
    if model.cfg.objective != "causal":  # the step-0 equivalence check runs the causal forward
        raise InvalidValueError(
            f"source: {name!r} is a {model.cfg.objective} model; upcycling needs a causal one"
        )
    return model.eval(), tok


def _check_args(experts: Any, top_k: Any, granularity: Any, seed: Any) -> None:
    """Cheap checks before loading anything (the full check needs the FFN width)."""
    for arg, v, low in (
        ("experts", experts, 1),
        ("top_k", top_k, 1),
        ("granularity", granularity, 1),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise InvalidValueError(f"{arg}: must be an int >= {low}, got {v!r}")
    if top_k > experts:
        raise InvalidValueError(f"top_k: must be in [1, experts={experts}], got {top_k}")
    check_seed(seed)


def upcycle_command(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    experts: int,
    top_k: int,
    granularity: int = 1,
    seed: int = 0,
    *,
    force: bool = False,
    router_init: str = "virtual_group",
    first_dense_layers: int = 0,
) -> UpcycleResult:
    """Upcycle ``source`` into an MoE model and write model + tokenizer to the run folder ``out``.

    Args:
        source: ``"smollm2"`` (see :mod:`moelab.interop.pretrained`) or a folder written by
            ``save_model`` + ``Tokenizer.save`` holding a dense model.
        out: the run folder to write (created; parents too).
        experts: E, copies of each dense FFN; the MoE layers get E·granularity experts.
        top_k: k, copies active per token (k·granularity experts).
        granularity: G, slices per FFN (divides the FFN width).
        seed: seeds the router initialisation.
        force: replace an existing non-empty ``out``.
        router_init: ``"virtual_group"`` or ``"random"`` (G = 1 only); see
            :func:`moelab.train.upcycle.upcycle`.
        first_dense_layers: keep the first n layers dense.
    Returns:
        :class:`UpcycleResult` with the measured dense-vs-MoE logit difference on
        :data:`PROBE_TEXT`.
    Raises:
        ValueError: bad arguments (named), bad source.
        OutputFolderError: ``out`` is, contains or lies inside the source, or holds files
            moelab did not write (see :func:`moelab.utils.outdir.check_output_folder`);
            ``OutputExistsError`` (a ``FileExistsError``) when it is non-empty and not ``force``.
        RuntimeError: the written model does not reproduce the dense logits (a bug).
    """
    t0 = time.perf_counter()
    _check_args(experts, top_k, granularity, seed)
    if router_init not in ROUTER_INITS:
        raise InvalidValueError(f"router_init: must be one of {ROUTER_INITS}, got {router_init!r}")
    out = Path(out)
    src_path = Path(source)
    inputs = [src_path] if src_path.exists() else []
    check_output_folder(out, inputs=inputs, overwrite=force, flag="--force")

    dense, tok = load_dense_source(source)
    spec = upcycle_spec(dense.cfg.dense_ffn_size, experts, top_k, granularity, None, router_init)
    moe = upcycle(
        dense,
        experts,
        top_k,
        granularity,
        router_init=router_init,  # type: ignore[arg-type]
        seed=seed,
        first_dense_layers=first_dense_layers,
    ).eval()

    ids = tok.encode(PROBE_TEXT)[: dense.cfg.max_seq_len] or [0]
    probe = torch.tensor([ids], dtype=torch.long, device=dense.embed.weight.device)
    with torch.no_grad():
        scale = float(dense(probe).logits.double().abs().max())
    diff = max_logit_diff(dense, moe, probe)
    complete = selects_complete_copies(moe, probe, granularity)
    tol = (1e-3 if dense.embed.weight.dtype == torch.float32 else 5e-2) * (1.0 + scale)
    if not diff <= tol:
        raise RuntimeError(
            f"upcycled model differs from the dense model by {diff:.3g} in the logits "
            f"(tolerance {tol:.3g}); please report this"
        )
    result = UpcycleResult(
        out=out,
        source=str(source),
        config=moe.cfg,
        num_experts=spec.num_experts,
        top_k=spec.top_k,
        granularity=granularity,
        params=count_params(moe),
        dense_params=sum(p.numel() for p in dense.parameters()),
        max_abs_logit_diff=diff,
        max_abs_logit=scale,
        complete_copies=complete,
        probe_tokens=len(ids),
    )
    del dense

    info = {
        "format_version": 1,
        "method": "sparse upcycling (arXiv 2212.05055), granular (arXiv 2410.07524)",
        "copies": spec.copies,
        "top_k_copies": spec.top_k_copies,
        "router_init": router_init,
        "seed": seed,
        "down_scale": spec.down_scale,
        **result.to_dict(),
    }
    info.pop("out")
    info.pop("seconds")

    def fill(tmp: Path) -> None:
        tok.save(tmp)  # first, so that the manifest checksums the tokenizer files too
        save_model(moe, tmp, extra_files=tokenizer_files(tmp))
        atomic_write_json(tmp / UPCYCLE_FILE, info, sort_keys=True)

    write_folder_atomically(out, fill, overwrite=force, inputs=inputs, flag="--force")
    result.seconds = time.perf_counter() - t0
    return result


@app.command("upcycle")
def upcycle_cmd(
    source: Annotated[str, Opt("--from", help="Dense model: 'smollm2' or a dense model folder.")],
    out: Annotated[Path, Opt(help="Run folder to write.")],
    experts: Annotated[int, Opt(help="E: copies of each dense FFN."), Range(min=1)] = 8,
    top_k: Annotated[int, Opt(help="k: copies active per token."), Range(min=1)] = 2,
    granularity: Annotated[
        int, Opt(help="G: split each copy into G finer experts."), Range(min=1)
    ] = 1,
    seed: Annotated[int, Opt(help="Router initialisation seed."), SEED] = 0,
    force: Annotated[bool, Opt(help="Replace a non-empty --out.")] = False,
) -> None:
    """Sparse upcycling: turn a dense model into an MoE whose output is identical at step 0.

    Examples:
      moelab upcycle --from smollm2 --experts 8 --top-k 2 --out runs/smollm2-moe
      moelab generate runs/smollm2-moe --prompt "The capital of France is" --temperature 0
      moelab train --init-from runs/smollm2-moe --data mix --steps 50 --lr 1e-4 --out runs/smollm2-ft
    """
    try:
        result = guarded(
            upcycle_command, source, out, experts, top_k, granularity, seed, force=force
        )
    except PretrainedNotInstalledError as exc:
        fail(exc)
    p = result.params
    console.print(
        f"upcycled {source} -> {out}: {result.num_experts} experts, {result.top_k} active, "
        f"{p['total'] / 1e6:.1f}M params ({p['active_per_token'] / 1e6:.1f}M active); "
        f"max |logit difference| vs dense {result.max_abs_logit_diff:.2e}"
    )
