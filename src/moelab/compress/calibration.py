"""Calibration for compression: which text, which token batches, and routing them through a
model with per-MoE-layer observers.

Shared by pruning (:mod:`moelab.compress.prune`) and quantisation (GPTQ-style Hessians need the
inputs each expert receives). The pieces, each usable alone:

1. :func:`calibration_documents` — the calibration text: a corpus named by ``--calib-data``
   (any :func:`moelab.data.load_corpus` spec), or by default the run's own training domains,
   held-out documents (see :func:`held_out_documents`).
2. :func:`calibration_set` — ``tokens`` tokens of that text as ``[B, S]`` batches, an equal
   share per domain, as non-overlapping windows at seeded random positions.
3. :func:`route` — run the batches through the model (eval mode, no grad) and call an
   observer ``fn(i, layer, x, out)`` after every MoE layer; optionally stop the pass after a
   given MoE layer (sequential layer-wise methods only need the layers up to the one they
   work on).
4. :func:`routed_pairs` / :func:`expert_outputs` — the rows each expert received in one layer
   call (sorted by expert, with their combine weights) and the experts' outputs on them.

Choices of this project [I]: the default calibration text is the *first half* of the run's
validation documents (``split_documents(val_docs, val_fraction=0.5, seed=...)``), so the
second half (:func:`held_out_documents` ``[1]``) stays unseen for evaluating the compressed
model; RaGEP's code calibrates on C4, which is not available offline.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from moelab.core.layer import MoELayer, MoEOutput
from moelab.core.plan import RoutingPlan
from moelab.data import CorpusError, Document, Tokenizer, TokenStream, load_corpus, split_documents
from moelab.errors import InvalidValueError
from moelab.models.hooks import LayerObserver, observe_moe_layers
from moelab.utils.jsonfile import read_json

HELD_OUT_SPLIT_SEED = 1234
"""Seed of the 50/50 split of the run's validation documents into calibration / evaluation."""


@dataclass(frozen=True)
class RunData:
    """Where a run's training text came from (the ``train`` section of its ``run.json``).

    Attributes:
        data: corpus spec given to ``moelab train --data``.
        max_bytes_per_domain: the cap used for training (None = none).
        val_fraction: the run's validation fraction.
        seed: the run's split seed.
    """

    data: str
    max_bytes_per_domain: int | None = None
    val_fraction: float = 0.05
    seed: int = 0


def run_data(folder: str | Path) -> RunData | None:
    """The :class:`RunData` recorded in a run folder's ``run.json`` ``train`` section (None
    for a bare model folder without one). The split seed is the run's ``split_seed`` where it
    set one (a multi-seed comparison on one held-out set), else its ``seed``, as in training.

    Raises:
        ValueError: ``run.json`` exists but is malformed (names the file).
    """
    path = Path(folder) / "run.json"
    if not path.exists():
        return None
    info = read_json(path)
    train = info.get("train") if isinstance(info, dict) else None
    if not isinstance(train, dict) or not isinstance(train.get("data"), str):
        raise InvalidValueError(f"{path}: no 'train' section naming the training data")
    split_seed = train.get("split_seed")
    return RunData(
        data=train["data"],
        max_bytes_per_domain=train.get("max_bytes_per_domain"),
        val_fraction=train.get("val_fraction", 0.05),
        seed=train.get("seed", 0) if split_seed is None else split_seed,
    )


def held_out_documents(run: RunData) -> tuple[list[Document], list[Document]]:
    """The run's validation documents (never trained on), split 50/50 per domain into
    ``(calibration, evaluation)`` with :data:`HELD_OUT_SPLIT_SEED` (a one-document domain is
    split by text position, see :func:`moelab.data.split_documents`).

    Raises:
        CorpusError, CorpusNotInstalledError: the run's corpus cannot be loaded.
    """
    _, val = _run_split(run)
    evaluation, calibration = split_documents(val, val_fraction=0.5, seed=HELD_OUT_SPLIT_SEED)
    return calibration, evaluation


def training_documents(run: RunData) -> list[Document]:
    """The run's training documents, as calibration text where the held-out half is too short
    for the papers' calibration counts. The papers calibrate on C4, pretraining-style text of
    the kind their models were trained on; evaluation stays on :func:`held_out_documents`'s
    second half, which no split puts in training.

    Raises:
        CorpusError, CorpusNotInstalledError: the run's corpus cannot be loaded.
    """
    return _run_split(run)[0]


def _run_split(run: RunData) -> tuple[list[Document], list[Document]]:
    docs = load_corpus(run.data, max_bytes_per_domain=run.max_bytes_per_domain)
    return split_documents(docs, val_fraction=run.val_fraction, seed=run.seed)


def calibration_documents(calib_data: str | None, run: RunData | None) -> list[Document]:
    """The calibration text: every document of ``calib_data`` (a :func:`load_corpus` spec),
    or, when it is None, the calibration half of the run's held-out documents.

    Raises:
        ValueError: neither ``calib_data`` nor ``run`` is given (a bare model folder has no
            training text: pass ``--calib-data``).
        CorpusError: the corpus cannot be loaded (names the path).
    """
    if calib_data is not None:
        return load_corpus(calib_data)
    if run is None:
        raise InvalidValueError(
            "calib_data: the model folder records no training data; pass a corpus "
            "(e.g. --calib-data mix)"
        )
    return held_out_documents(run)[0]


def domain_streams(
    docs: Sequence[Document], tokenizer: Tokenizer, *, prefix: str = ""
) -> dict[str, TokenStream]:
    """One token stream per domain (sorted domain names; ids agree across streams).

    Raises:
        CorpusError: ``docs`` is empty.
    """
    if not docs:
        raise CorpusError(f"{prefix or 'calibration'}: no documents")
    names = sorted({d.domain for d in docs})
    return {
        n: TokenStream.from_documents(
            [d for d in docs if d.domain == n], tokenizer, domain_names=names, name=prefix + n
        )
        for n in names
    }


@dataclass(frozen=True)
class CalibrationSet:
    """Calibration token batches (re-iterable, deterministic).

    Attributes:
        batches: ``[B, S]`` int64 input ids each (the last batch may have fewer rows).
        domains: per batch, ``[B]`` int64 domain id of each row (index into ``domain_names``).
        domain_names: the domains, sorted.
        seed: the seed the windows were drawn with.
    """

    batches: tuple[Tensor, ...]
    domains: tuple[Tensor, ...]
    domain_names: tuple[str, ...]
    seed: int

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def n_tokens(self) -> int:
        """Total tokens over all batches."""
        return sum(b.numel() for b in self.batches)


def calibration_set(
    streams: dict[str, TokenStream],
    *,
    tokens: int,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
) -> CalibrationSet:
    """``tokens`` calibration tokens as batches of ``seq_len``-token windows.

    Each domain contributes ``ceil(tokens / (n_domains · seq_len))`` windows (so the total is
    ``tokens`` rounded up to whole windows per domain), drawn without overlap: the stream is cut
    into consecutive windows after a random offset in ``[0, seq_len)`` and a random subset is
    taken; rows are then shuffled across domains. Everything is drawn from one
    ``torch.Generator`` seeded with ``seed``.

    Args:
        streams: one stream per domain (e.g. :func:`domain_streams`).
        tokens: calibration tokens wanted (>= 1).
        seq_len: S (>= 1).
        batch_size: rows per batch (>= 1).
        seed: window-sampling seed.
    Raises:
        ValueError: a size below 1 or no stream.
        CorpusError: a domain's text is shorter than its share of windows (names the domain,
            the tokens it has and the tokens needed).
    """
    for name, v in (("tokens", tokens), ("seq_len", seq_len), ("batch_size", batch_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InvalidValueError(f"{name}: must be an int >= 1, got {v!r}")
    if not streams:
        raise InvalidValueError("streams: no calibration stream given")
    gen = torch.Generator().manual_seed(seed)
    per_domain = math.ceil(tokens / (len(streams) * seq_len))
    rows: list[Tensor] = []
    row_domain: list[int] = []
    names = tuple(streams)
    for d, (name, stream) in enumerate(streams.items()):
        n = len(stream)
        offset = (
            int(torch.randint(0, seq_len, (1,), generator=gen)) if n > seq_len * per_domain else 0
        )
        available = (n - offset) // seq_len
        if available < per_domain:
            raise CorpusError(
                f"calib_tokens: domain {name!r} has {n} calibration tokens, fewer than the "
                f"{per_domain * seq_len} needed ({per_domain} windows of {seq_len}); lower "
                "--calib-tokens or give more text"
            )
        pick = torch.randperm(available, generator=gen)[:per_domain]
        starts = offset + pick * seq_len
        idx = starts[:, None] + torch.arange(seq_len)
        rows.append(stream.ids[idx])
        row_domain += [d] * per_domain
    ids = torch.cat(rows)
    dom = torch.tensor(row_domain, dtype=torch.int64)
    order = torch.randperm(ids.shape[0], generator=gen)
    ids, dom = ids[order], dom[order]
    return CalibrationSet(
        batches=tuple(ids.split(batch_size)),
        domains=tuple(dom.split(batch_size)),
        domain_names=names,
        seed=seed,
    )


class _StopPass(Exception):
    """Raised by the observer to end a forward pass after the last layer of interest."""


@torch.no_grad()
def route(
    model: nn.Module,
    batches: Iterable[Tensor],
    observer: LayerObserver,
    *,
    upto_layer: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> int:
    """Run ``batches`` through ``model`` in eval mode without gradients, calling
    ``observer(i, layer, x, out)`` after MoE layer ``i`` of every batch.

    Args:
        model: an :class:`~moelab.models.MoETransformer` (any module whose forward takes
            ``[B, S]`` ids and contains :class:`~moelab.core.layer.MoELayer` s).
        batches: ``[B, S]`` int64 ids (e.g. a :class:`CalibrationSet`); moved to the model's
            device.
        observer: see :func:`moelab.models.hooks.observe_moe_layers`.
        upto_layer: stop each forward pass right after MoE layer ``upto_layer`` (0-based
            among MoE layers); None runs the whole model.
        on_batch: called with the batch's token count after each batch (progress bars).
    Returns:
        Tokens routed.
    Raises:
        ValueError: the model has no MoE layer, or ``upto_layer`` is out of range.
    """

    def observe(i: int, layer: MoELayer, x: Tensor, out: MoEOutput) -> None:
        observer(i, layer, x, out)
        if upto_layer is not None and i == upto_layer:
            raise _StopPass

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = 0
    try:
        with observe_moe_layers(model, observe) as layers:
            if upto_layer is not None and not 0 <= upto_layer < len(layers):
                raise InvalidValueError(
                    f"upto_layer: must be in [0, {len(layers) - 1}] (MoE layers), got {upto_layer}"
                )
            for ids in batches:
                with contextlib.suppress(_StopPass):
                    model(ids.to(device))
                total += ids.numel()
                if on_batch is not None:
                    on_batch(ids.numel())
    finally:
        model.train(was_training)
    return total


@dataclass(frozen=True)
class RoutedPairs:
    """The (token, expert) pairs of one MoE layer call, sorted by expert.

    Attributes:
        x: ``[N, D]`` input row of every pair (layer input dtype), expert-sorted.
        counts: ``[E]`` int64 pairs per expert (``x`` holds expert 0's rows first).
        token_idx: ``[N]`` int64 token (row of the flattened ``[T, D]`` input) of each pair.
        expert_idx: ``[N]`` int64 expert of each pair (non-decreasing).
        weight: ``[N]`` float32 combine weight of each pair (the router's top-k weight,
            renormalised/scaled as the router does).
    """

    x: Tensor
    counts: Tensor
    token_idx: Tensor
    expert_idx: Tensor
    weight: Tensor


def routed_pairs(layer: MoELayer, x: Tensor, plan: RoutingPlan) -> RoutedPairs:
    """Group the layer input ``x`` ``[..., D]`` by the experts ``plan`` routed it to (the
    layer's own dispatcher does the sort)."""
    x_TD = x.reshape(-1, x.shape[-1])
    d = layer.dispatcher.dispatch(x_TD, plan)
    weight = d.weight if d.weight is not None else d.pair_weight[d.order]
    return RoutedPairs(
        x=d.x,
        counts=d.counts,
        token_idx=d.token_idx,
        expert_idx=plan.expert_idx[d.order],
        weight=weight.detach().float(),
    )


def expert_outputs(layer: MoELayer, pairs: RoutedPairs) -> Tensor:
    """``f_e(x)`` of every pair, ``[N, D]`` in the experts' dtype (not weighted)."""
    return layer.experts(pairs.x.to(layer.experts.w_down.dtype), pairs.counts)
