"""Router replay: record the experts every token-choice router picks in one forward pass and
replay exactly that routing in a later pass (Megatron-Core's ``RouterReplay``; what RL
training needs so the trainer's forward routes like the rollout engine did).

While replaying, each router takes its recorded ``[T, k]`` expert indices instead of its own
top-k selection; the combine weights are recomputed from the current router logits with the
router's weight rule (so the router still gets gradients), and capacity dropping, if
configured, is re-applied. Recording overwrites and replaying reads one tensor per router, so
activation checkpointing (which re-runs forward) records and replays the same routing.

Example::

    with record_routing(model) as routes:   # routes: {router name: [T, k] int64}
        model(ids)
    with replay_routing(model, routes):
        out = model(ids)                     # same experts for every token
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from moelab.core.plan import check_expert_ids
from moelab.core.routers.token_choice import TopKRouter
from moelab.errors import InvalidValueError


class RouterReplay:
    """Per-router record/replay state.

    Attributes:
        mode: ``"record"`` (store each forward's selection) or ``"replay"`` (use ``indices``).
        indices: ``[T, k]`` int64 expert indices (recorded, or given to replay).
    """

    def __init__(self, mode: str, indices: Tensor | None = None) -> None:
        if mode not in ("record", "replay"):
            raise InvalidValueError(f"mode: must be record or replay, got {mode!r}")
        if mode == "replay" and indices is None:
            raise InvalidValueError("indices: replay needs the recorded [T, k] expert indices")
        self.mode = mode
        self.indices = indices

    def store(self, idx_Tk: Tensor) -> None:
        """Record a forward's selection (overwrites: a recomputed forward stores the same)."""
        self.indices = idx_Tk.detach()

    def replayed(self, num_tokens: int, top_k: int, num_experts: int, device) -> Tensor:
        """The recorded indices checked against this forward's ``(T, k)`` and E.

        Raises:
            ValueError: the recording has another shape (a different batch) or an index
                outside ``[0, E)``.
            TypeError: the recording is not an integer tensor.
        """
        idx = self.indices
        if idx.shape != (num_tokens, top_k):
            raise InvalidValueError(
                f"replay: recorded indices are {idx.dtype} {tuple(idx.shape)}, this forward "
                f"routes [{num_tokens}, {top_k}]; replay the same batch that was recorded"
            )
        return check_expert_ids(idx, num_experts, "replay").to(device=device)


def _routers(model: nn.Module) -> dict[str, TopKRouter]:
    routers = {n: m for n, m in model.named_modules() if isinstance(m, TopKRouter)}
    if not routers:
        raise InvalidValueError("model: has no token-choice router to record or replay")
    return routers


@contextmanager
def record_routing(model: nn.Module) -> Iterator[dict[str, Tensor]]:
    """Record the selection of every token-choice router of ``model`` in the block.

    Yields a dict that, after the block, maps each router's module name to the ``[T, k]``
    int64 experts of the *last* forward run inside the block.
    """
    routers = _routers(model)
    routes: dict[str, Tensor] = {}
    before = {n: r.replay for n, r in routers.items()}
    for r in routers.values():
        r.replay = RouterReplay("record")
    try:
        yield routes
    finally:
        for n, r in routers.items():
            if r.replay is not None and r.replay.indices is not None:
                routes[n] = r.replay.indices
            r.replay = before[n]


@contextmanager
def replay_routing(model: nn.Module, routes: dict[str, Tensor]) -> Iterator[None]:
    """Route every token-choice router of ``model`` by ``routes`` (from :func:`record_routing`)
    inside the block.

    Raises:
        ValueError: ``routes`` does not name exactly the model's routers.
    """
    routers = _routers(model)
    if set(routes) != set(routers):
        missing = sorted(set(routers) - set(routes))
        extra = sorted(set(routes) - set(routers))
        raise InvalidValueError(
            f"routes: do not match the model's routers (missing {missing}, unknown {extra})"
        )
    before = {n: r.replay for n, r in routers.items()}
    for n, r in routers.items():
        r.replay = RouterReplay("replay", routes[n])
    try:
        yield
    finally:
        for n, r in routers.items():
            r.replay = before[n]
