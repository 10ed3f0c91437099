"""CoME: stage experts for GUI-agent reasoning, trained progressively, with Info-DPO.

Paper: Liu, Xu, Huang, Chen, Zhao, Gao, Liu, Luan, Shang, Du, Wen, Yan, "CoME: Empowering
Channel-of-Mobile-Experts with Informative Hybrid-Capabilities Reasoning", ICML 2026, arXiv
2602.24142 (METHODS.md #19). No public code: this is our reading of the abstract and secondary
digests (``shared/research/wave3-agents-alignment.md`` §3; [P] paper text, [S] secondary,
[I] our choice):

* four experts, one per reasoning stage (screen summary, subtask plan, action decision, action
  function), that share attention and duplicate the FFN channels [S]: sparse upcycling of a
  dense warm-up LM into 4 copies with top-1 routing [I] (:mod:`.model`);
* output-oriented activation: each position is routed to the expert of the stage of the token
  it produces [P] (:mod:`.tokens`);
* progressive training: Expert-FT (routing forced to the stage labels by router replay),
  Router-FT (routers only, cross-entropy to the stage), CoT-FT (joint, plus a Router-Norm whose
  form is unpublished, read as the router z-loss [I]) (:mod:`.train`);
* Info-DPO: the information gain of each reasoning stage about the correct action, from a
  reward LM, ranks sampled chains into DPO pairs [S] (:mod:`.dpo`);
* arms: dense (equal active parameters), token-MoE (learned input-oriented top-1 router), CoME,
  CoME without Router-FT, optional Info-DPO / Rule-DPO.

This project's setting [I]: real MiniWoB++ web pages (8 tasks) in headless Chromium with scripted
oracles instead of AITZ/AMEX phone screens, chains in AITZ's four-stage CoAT format
(:mod:`.browser`, :mod:`.oracle`, :mod:`.chain`; the generated set ships as package data), a
1 M-parameter LM with a BPE tokenizer trained on the chains instead of a 5 B VLM.

Entry points: :class:`~moelab.methods.agents.recipe.ComeRecipe` (for
:func:`moelab.methods.runner.run_seeds`), :func:`~moelab.methods.agents.chain.read_chains`,
:func:`~moelab.methods.agents.browser.generate_chains`; ``moelab agent generate|train``;
``benchmarks/come.py``.
"""

from moelab.methods.agents.chain import ChainStep, read_chains, write_chains
from moelab.methods.agents.config import ARMS, ComeConfig
from moelab.methods.agents.dpo import dpo_loss, information_gain, reasoning_reward
from moelab.methods.agents.recipe import AgentRun, ComeRecipe

__all__ = [
    "ARMS",
    "AgentRun",
    "ChainStep",
    "ComeConfig",
    "ComeRecipe",
    "dpo_loss",
    "information_gain",
    "read_chains",
    "reasoning_reward",
    "write_chains",
]
