"""The MiniGrid policy every arm shares: a trunk, an MoE head and (per arm) a router.

``π(a | s_t, e_t) = softmax(W_o (h_t + MoE_{e_t}(h_t)))`` with ``h_t = trunk(o_t)`` [I]:

* trunk: each view cell is the sum of its object, colour and state embeddings; the 49 cells,
  the direction embedding and the mean mission-word embedding → a 2-layer MLP → ``h ∈ R^H``
  (trainable in every arm; the paper's LLM trunk is frozen, a random frozen trunk is useless);
* head: a :class:`~moelab.core.layer.MoELayer` of GELU experts on ``h`` with an always-on
  shared expert, then a linear map to the 7 action logits. The ``single`` arm has one expert
  of width ``E·expert_size`` (equal total parameters);
* routing: ``step`` lets the layer's own top-1 token-choice router pick per step (gradient
  through the gate weight, Switch balance loss); ``pamoe`` and ``trajectory`` hand the layer a
  plan from :class:`~moelab.core.routers.phase.PhaseRouter` (weight 1: the router learns by
  REINFORCE); ``single`` routes everything to its one expert.

The phase router reads the view cells and mission words (their embeddings, detached: its
REINFORCE gradient does not shape the trunk [I]) and the trunk features of the last
``history`` steps (stored at rollout time [I]).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer
from moelab.core.routers.phase import PhaseRouter, step_plan
from moelab.methods.rl.config import RLConfig
from moelab.methods.rl.envs import NUM_ACTIONS, NUM_COLOURS, NUM_OBJECTS, NUM_STATES, VIEW


class MiniGridPolicy(nn.Module):
    """Trunk + MoE head + value head (+ phase router for ``pamoe``/``trajectory``).

    Args:
        config: the run's settings (arm, sizes).
        vocab_size: mission words + 1 (id 0 pads).
    """

    def __init__(self, config: RLConfig, vocab_size: int) -> None:
        super().__init__()
        self.arm = config.arm
        d, H = config.embed_size, config.hidden_size
        self.obj = nn.Embedding(NUM_OBJECTS, d)
        self.colour = nn.Embedding(NUM_COLOURS, d)
        self.state = nn.Embedding(NUM_STATES, d)
        self.direction = nn.Embedding(4, d)
        self.word = nn.Embedding(vocab_size, d, padding_idx=0)
        self.trunk = nn.Sequential(
            nn.Linear((VIEW * VIEW + 2) * d, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU()
        )
        E = config.routed
        step = config.arm == "step"
        self.moe = MoELayer(
            MoEConfig(
                router=RouterConfig(num_experts=E, top_k=1, norm_topk_prob=False),
                experts=ExpertsConfig(
                    hidden_size=H,
                    ffn_hidden_size=config.expert_size * config.num_experts // E,
                    activation="gelu",
                    shared_expert_size=config.shared_size,
                ),
                losses=LossConfig(
                    load_balance="switch" if step else "none",
                    aux_loss_coeff=config.step_balance_coef if step else 0.0,
                    z_loss_coeff=0.0,
                ),
            )
        )
        self.out = nn.Linear(H, NUM_ACTIONS)
        self.value = nn.Linear(H, 1)
        self.router = (
            PhaseRouter(d, d, H, E, hidden_size=config.router_size)
            if config.arm in ("pamoe", "trajectory")
            else None
        )

    @property
    def num_experts(self) -> int:
        return self.moe.config.router.num_experts

    def encode(self, image: Tensor, direction: Tensor, mission: Tensor) -> tuple[Tensor, ...]:
        """``(h [B, H], cells [B, 49, d], words [B, M, d], word_mask [B, M])`` from
        ``image [B, 7, 7, 3]``, ``direction [B]`` and ``mission [B, M]`` int64."""
        B = image.shape[0]
        cells = (
            self.obj(image[..., 0]) + self.colour(image[..., 1]) + self.state(image[..., 2])
        ).reshape(B, VIEW * VIEW, -1)
        words = self.word(mission)
        mask = mission > 0
        pooled = words.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        x = torch.cat([cells.reshape(B, -1), self.direction(direction), pooled], dim=-1)
        return self.trunk(x), cells, words, mask

    def router_logits(self, cells: Tensor, words: Tensor, mask: Tensor, history: Tensor) -> Tensor:
        """The phase router's logits ``[B, E]`` (inputs detached from the trunk [I])."""
        return self.router(cells.detach(), words.detach(), mask, history)

    def head(self, h: Tensor, experts: Tensor | None, router_logits: Tensor | None = None):
        """Action logits ``[B, 7]`` and the MoE layer's output (aux losses, plan).

        Args:
            h: ``[B, H]`` trunk features.
            experts: ``[B]`` int64 forced experts (``pamoe``, ``trajectory``, ``single``:
                zeros), or None for the ``step`` arm's own router.
            router_logits: ``[B, E]`` kept in the plan (telemetry); default zeros.
        """
        plan = None
        if experts is not None:
            logits = (
                router_logits
                if router_logits is not None
                else h.new_zeros(h.shape[0], self.num_experts)
            )
            plan = step_plan(experts, logits.detach())
        out = self.moe(h, plan=plan)
        return self.out(h + out.hidden_states), out

    def value_of(self, h: Tensor) -> Tensor:
        """State values ``[B]`` (used by the GAE estimator only)."""
        return self.value(h).squeeze(-1)
