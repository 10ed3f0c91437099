"""Memory a model config needs, estimated from the config alone before anything is allocated,
and a refusal when it exceeds what the machine has.

:func:`estimate_parameters` counts the parameters of :class:`~moelab.models.MoETransformer`
analytically (embeddings, attention, norms, dense FFNs, router, expert bank, shared expert,
LM head); :func:`check_model_fits` compares ``parameters × bytes per element`` with the
memory available (``MemAvailable`` of ``/proc/meminfo``, capped by a cgroup v2 ``memory.max``)
and raises :class:`ModelTooLargeError` naming the biggest part of the model. The model
constructor calls it, so every path that builds a model (train, load, convert, upcycle) is
covered. ``MOELAB_ALLOW_LARGE_MODEL=1`` skips the check (for the brave: swap, mmap).
Our choice: the check counts parameters only (fp32 unless told otherwise); activations and
optimizer state come on top, so passing it does not promise training fits.
"""

from __future__ import annotations

import os
from pathlib import Path

from moelab.core.config import GATED_ACTIVATIONS
from moelab.errors import InvalidValueError
from moelab.models.config import ModelConfig

ENV_OVERRIDE = "MOELAB_ALLOW_LARGE_MODEL"


class ModelTooLargeError(InvalidValueError):
    """A model config needs more memory than the machine has available."""


def parameter_parts(cfg: ModelConfig) -> dict[str, int]:
    """Parameter count of each part of the model built from ``cfg`` (exact for this codebase).

    Keys: ``embeddings`` (input embedding + untied LM head), ``attention`` (all layers,
    projections, biases, q/k norms), ``norms``, ``dense_ffn``, ``routers``, ``experts``
    (routed expert banks of all MoE layers), ``shared_experts``.
    """
    D, V, L, H, kv, hd = (
        cfg.d_model,
        cfg.vocab_size,
        cfg.n_layers,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
    )
    n_moe = cfg.num_moe_layers
    n_dense = L - n_moe
    attn = D * H * hd + 2 * D * kv * hd + H * hd * D
    if cfg.attention_bias:
        attn += H * hd + 2 * kv * hd
    if cfg.qk_norm == "head":
        attn += 2 * hd
    elif cfg.qk_norm == "full":
        attn += H * hd + kv * hd
    parts = {
        "embeddings": V * D * (1 if cfg.tie_embeddings else 2),
        "attention": L * attn,
        "norms": (2 * L + 1) * D,
        "dense_ffn": n_dense * 3 * D * cfg.dense_ffn_size,
        "routers": 0,
        "experts": 0,
        "shared_experts": 0,
    }
    if cfg.moe is not None:
        E = cfg.moe.router.num_experts
        ex = cfg.moe.experts
        mats = 3 if ex.activation in GATED_ACTIVATIONS else 2
        parts["routers"] = n_moe * E * D
        parts["experts"] = n_moe * E * mats * D * ex.ffn_hidden_size
        if ex.shared_expert_size:
            parts["shared_experts"] = n_moe * (
                3 * D * ex.shared_expert_size + (D if ex.shared_expert_gate else 0)
            )
    return parts


def estimate_parameters(cfg: ModelConfig) -> int:
    """Total parameters of the model built from ``cfg`` (see :func:`parameter_parts`)."""
    return sum(parameter_parts(cfg).values())


def available_memory_bytes() -> int | None:
    """Bytes of memory this process can still get, or None when it cannot be told."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        return None
    try:
        cg = Path("/sys/fs/cgroup")
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cg / "memory.current").read_text().strip())
            room = int(limit) - used
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check_model_fits(cfg: ModelConfig, bytes_per_param: int = 4) -> None:
    """Refuse a config whose parameters alone exceed the available memory.

    Args:
        cfg: the model config (already validated field by field).
        bytes_per_param: element size of the weights (4 = fp32, 2 = bf16).
    Raises:
        ModelTooLargeError: naming the estimate, the memory available, the largest part and
            the override :data:`ENV_OVERRIDE`.
    """
    if os.environ.get(ENV_OVERRIDE, "") not in ("", "0"):
        return
    avail = available_memory_bytes()
    if avail is None:
        return
    parts = parameter_parts(cfg)
    need = sum(parts.values()) * bytes_per_param
    if need <= avail:
        return
    big = max(parts, key=parts.get)
    detail = {
        "experts": f"num_experts={cfg.moe.router.num_experts if cfg.moe else 0}, "
        f"ffn_hidden_size={cfg.moe.experts.ffn_hidden_size if cfg.moe else 0}",
        "embeddings": f"vocab_size={cfg.vocab_size}, d_model={cfg.d_model}",
        "attention": f"n_layers={cfg.n_layers}, d_model={cfg.d_model}, n_heads={cfg.n_heads}",
        "dense_ffn": f"dense_ffn_size={cfg.dense_ffn_size}, n_layers={cfg.n_layers}",
    }.get(big, f"n_layers={cfg.n_layers}, d_model={cfg.d_model}")
    raise ModelTooLargeError(
        f"model config: needs about {_gb(need)} for {sum(parts.values()):.3g} parameters "
        f"(mostly {big}: {detail}), but only {_gb(avail)} of memory is available; "
        f"check the config, or set {ENV_OVERRIDE}=1 to try anyway"
    )
