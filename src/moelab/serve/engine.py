"""The batched generation engine: continuous batching over a slotted KV cache.

One engine owns one loaded :class:`~moelab.models.MoETransformer` (trained, imported,
upcycled, pruned or quantized: whatever :func:`moelab.serve.load.load_serving_model` returns)
and runs an iteration loop (Orca, Yu et al. OSDI 2022: "iteration-level scheduling"):

1. drop sequences that were cancelled (client gone) or ran past their deadline, freeing
   their cache rows;
2. admit waiting requests while rows are free (first come, first served, at most
   ``prefill_tokens`` padded prompt tokens per iteration but always at least one request):
   they are prefilled together in one forward pass, right-padded, each into a fresh row,
   and sample their first tokens;
3. one decode step for every running sequence together: ``[n, 1]`` tokens, each row at its
   own position (per-row RoPE offset and cache write), then per-row sampling with each
   sequence's own generator and settings; finished rows leave and the last row moves into
   the hole.

Failures are contained to the requests they concern, and the engine carries on: a row whose
logits are not finite or whose sampling raises ends alone with ``finish_reason="error"``; a
prefill that raises is retried one request at a time, so only the requests that fail alone
end with an error; a decode forward that raises ends every running request (one batched
forward cannot say which row caused it) and clears the cache. No request is ever dropped
without a :class:`FinishEvent`, so no client waits forever.

Our choices, labelled: prefill runs as its own forward pass before the decode step (not
chunked, not fused with decode), so a long prompt delays the running batch by one pass; the queue is FIFO without
preemption; a sequence that reaches the context length ends with ``finish_reason="length"``.
Every router decodes incrementally, USMoE ``causal_prefix`` included (its per-row router
state lives in the slotted cache, :class:`~moelab.serve.kv_slots.SlotKVCache`).

A sequence gets the same tokens in a batch as alone (:mod:`moelab.serve.batching` says which
routers couple the rows of a forward pass): layers with a capacity factor are served dropless,
as vLLM and SGLang serve them; USMoE ``position`` scope needs ``max_batch=1``.

The engine thread is the only one that touches the model and the cache; :meth:`submit`,
:meth:`Sequence.cancel` and :meth:`drain` are safe to call from any thread.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moelab.core.experts.quantized import QuantizedProjection, kernel_unreadable
from moelab.data import Tokenizer
from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models import MoETransformer
from moelab.serve.batching import check_batching, serving_routing
from moelab.serve.compiled import compiled_decode
from moelab.serve.detok import Detokenizer
from moelab.serve.fused import FusedDecode
from moelab.serve.kv_slots import SlotKVCache
from moelab.serve.params import SamplingParams
from moelab.serve.sampling import sample_next


def check_compilable(model: MoETransformer) -> None:
    """Refuse to compile the decode of a model whose quantized weights (``moelab quantize``)
    torch.compile cannot keep in one graph: codes the packed-code operator
    (``moelab::quant_rows_mm``) does not read (:func:`kernel_unreadable`: 2/3-bit, vector,
    act-order or rotated codes) or low-rank corrections, whose data-dependent shapes would
    break the graph at every layer (such compiled decodes measured 0.40-0.61x eager).

    Raises:
        InvalidValueError: naming the first such projection and why.
    """
    for name, m in model.named_modules():
        if not isinstance(m, QuantizedProjection):
            continue
        why = kernel_unreadable(m.spec)
        if why is None and m.lowrank is not None:
            why = f"{m.spec.lowrank} low-rank factors"
        if why:
            raise InvalidValueError(
                f"compile: quantized projection {name} has {why} and decodes eagerly (compiled "
                "decode takes 4- or 8-bit scalar codes without act-order, rotation or low-rank "
                "factors)"
            )


logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (the server answers 429)."""


class EngineClosedError(RuntimeError):
    """The engine is draining or stopped and admits nothing new (the server answers 503)."""


@dataclass
class TokenEvent:
    """One generated token.

    Attributes:
        token_id: the sampled id.
        text: text now safe to emit (may be "" while a character or a possible stop string
            is incomplete).
        token_text: the characters this token completed (for display).
        experts: when routing was requested, per MoE layer (in layer order) the experts
            chosen at the position that produced this token; else None.
    """

    token_id: int
    text: str
    token_text: str
    experts: list[list[int]] | None = None


@dataclass
class FinishEvent:
    """The sequence ended. ``reason`` is ``"stop"``, ``"length"``, ``"cancelled"`` or
    ``"timeout"`` or ``"error"`` (the forward pass or the sampling failed:
    :attr:`Sequence.error` says why); ``text`` is any held-back text released at the end."""

    reason: str
    text: str = ""


Event = TokenEvent | FinishEvent


@dataclass(eq=False)
class Sequence:
    """A request inside the engine. Read-only for callers, except :meth:`cancel`.

    Attributes:
        prompt_ids: the prompt tokens. output_ids: tokens generated so far.
        finish_reason: set once the sequence ended. text: the generated text (when the
            engine has a tokenizer). arrival, first_token_at, finished_at: ``time.monotonic``.
        error: with ``finish_reason == "error"``, one line saying why. exception: the
            exception that ended it, when one did (None for non-finite logits).
    """

    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Event], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    exception: BaseException | None = None
    _cancelled: bool = False
    _generator: torch.Generator | None = None
    _detok: Detokenizer | None = None

    def cancel(self) -> None:
        """Ask the engine to stop this sequence and free its cache row (thread-safe)."""
        self._cancelled = True

    @property
    def text(self) -> str:
        return self._detok.text if self._detok is not None else ""

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first token."""
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        n = len(self.output_ids)
        if n < 2 or self.finished_at is None or self.first_token_at is None:
            return None
        return (self.finished_at - self.first_token_at) / (n - 1)


@dataclass
class EngineStats:
    """Running totals (read by the metrics endpoint; plain ints and lists on the host).

    ``expert_counts[i][e]`` counts routed (token, expert) pairs of the ``i``-th MoE layer
    (``moe_layers[i]``) over every forward pass (prompts included).
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    moe_layers: list[int] = field(default_factory=list)
    expert_counts: list[list[int]] = field(default_factory=list)


class Engine:
    """Continuous-batching generation over one model.

    Args:
        model: any :class:`MoETransformer` (put in eval mode; the engine never trains it).
        tokenizer: needed for stop strings and text; without it events carry ids only.
        max_batch: most sequences decoding at once (cache rows).
        max_queue: most requests waiting for a row; :meth:`submit` raises
            :class:`QueueFullError` beyond it.
        prefill_tokens: prompt tokens admitted per iteration (at least one request always is).
        track_experts: accumulate per-layer expert counts into :attr:`stats`.
        compile: run the decode steps through ``torch.compile(..., dynamic=True)``
            (:func:`moelab.serve.compiled.compiled_decode`: one compile per model, shared by
            its engines; prefills stay eager). At batch 1 one graph serves every position
            and cache size; other batch sizes and rows at different positions add graphs.
            The first decode step compiles (tens of seconds on CPU); inductor's fused
            float32 arithmetic differs from eager in the last bits, so a greedy near-tie may
            resolve differently. The model's modules must not change while it is served
            (a changed module structure gets a new compile with the next engine).
        fused: run the decode steps through the fused C++ step
            (:class:`moelab.serve.fused.FusedDecode`: every block of a step in one call,
            no compile; prefills stay eager; layers with a capacity factor dropless, as the
            engine serves them). Float32 sums run in other orders than the
            modules', so logits agree to rounding (with 8-bit activations a last-bit
            difference can move an activation across a rounding step).

    Raises:
        ValueError: ``max_batch`` or ``max_queue`` < 1, a USMoE router that looks at
            future tokens (it cannot generate), USMoE ``position`` scope with
            ``max_batch > 1`` (:func:`moelab.serve.batching.check_batching`), or a
            block-diffusion model, or ``compile`` with quantized weights compiled decoding
            cannot keep in one graph (:func:`check_compilable`), ``fused`` with a model the
            fused step does not run (:func:`moelab.serve.fused.unsupported` names the part),
            or both ``compile`` and ``fused``.
    """

    def __init__(
        self,
        model: MoETransformer,
        tokenizer: Tokenizer | None = None,
        *,
        max_batch: int = 16,
        max_queue: int = 256,
        prefill_tokens: int = 2048,
        track_experts: bool = True,
        compile: bool = False,
        fused: bool = False,
    ) -> None:
        if not isinstance(model, MoETransformer):
            raise InvalidTypeError(f"model: expected MoETransformer, got {type(model).__name__}")
        for name, v in (("max_batch", max_batch), ("max_queue", max_queue)):
            if not isinstance(v, int) or v < 1:
                raise InvalidValueError(f"{name}: must be an int >= 1, got {v!r}")
        self.model = model.eval()
        self._batching = check_batching(model, max_batch)  # see moelab.serve.batching
        if compile and fused:
            raise InvalidValueError("compile, fused: choose one way to run the decode steps")
        if compile:
            check_compilable(model)
            self._decode_model = compiled_decode(model)
        elif fused:  # built with the routing the engine serves (capacity layers dropless)
            with serving_routing(self._batching):
                self._decode_model = FusedDecode(model)
        else:
            self._decode_model = model
        self.tokenizer = tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prefill_tokens = prefill_tokens
        self.track_experts = track_experts
        self.device = model.embed.weight.device
        with torch.inference_mode():  # like the buffers it grows into inside step()
            self.cache = self._make_cache()
        self.running: list[Sequence] = []  # row i of the cache holds running[i]
        self.waiting: deque[Sequence] = deque()
        self.stats = EngineStats()
        self.stats.moe_layers = [b.layer_idx for b in model.blocks if b.is_moe]
        self.stats.expert_counts = [
            [0] * b.ffn.config.router.num_experts for b in model.blocks if b.is_moe
        ]
        self._lock = threading.Condition()
        self._closed = False
        self._stop = False
        self._thread: threading.Thread | None = None

    def _make_cache(self) -> SlotKVCache | None:
        """The per-row decoding state of the causal path (subclasses decode otherwise)."""
        if self.model.cfg.objective != "causal":
            raise InvalidValueError(
                f"model: a {self.model.cfg.objective} model has no causal next-token path; "
                "serve it with moelab.serve.diffusion.DiffusionEngine"
            )
        self.model._check_cacheable()  # a router that looks at future tokens cannot generate
        return SlotKVCache(self.model, self.max_batch)

    # ---------------------------------------------------------------- public
    @property
    def max_seq_len(self) -> int:
        return self.model.cfg.max_seq_len

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[Event], None] | None = None,
    ) -> Sequence:
        """Queue a request; ``sink`` receives its events on the engine thread.

        Raises:
            ValueError: empty prompt, ids outside the vocabulary, a prompt that fills the
                context, or stop strings without a tokenizer.
            QueueFullError: the waiting queue is full. EngineClosedError: draining/stopped.
        """
        vocab = self.model.cfg.vocab_size
        if not prompt_ids:
            raise InvalidValueError("prompt: must encode to at least one token")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidValueError(f"prompt: token ids must be in [0, vocab_size={vocab})")
        if len(prompt_ids) >= self.max_seq_len:
            raise InvalidValueError(
                f"prompt: {len(prompt_ids)} tokens leave no room in the context of "
                f"{self.max_seq_len}"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidValueError("stop: stop strings need an engine with a tokenizer")
        seq = Sequence(list(prompt_ids), params, sink)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq._generator = torch.Generator(device=self.device).manual_seed(seed)
        if self.tokenizer is not None:
            seq._detok = Detokenizer(self.tokenizer, params.stop)
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine: shutting down, not accepting requests")
            if len(self.waiting) >= self.max_queue:
                raise QueueFullError(
                    f"queue: {len(self.waiting)} requests already waiting (max_queue={self.max_queue})"
                )
            self.waiting.append(seq)
            self._lock.notify_all()
        return seq

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Run one request to the end (stepping the engine here when no thread runs it)."""
        seq = self.submit(prompt_ids, params)
        while not seq.done.is_set():
            if self._thread is None:
                self.step()
            else:
                seq.done.wait(0.05)
        return seq

    @property
    def closed(self) -> bool:
        """True once :meth:`drain` or :meth:`stop` was called (nothing new is admitted)."""
        return self._closed

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def alive(self) -> bool:
        """False when :meth:`start` ran but the loop thread is gone while the engine is not
        stopped (nothing would ever finish the queued requests)."""
        return self._thread is None or self._thread.is_alive()

    # ------------------------------------------------------------ threading
    def start(self) -> None:
        """Run the iteration loop on a daemon thread."""
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="moelab-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self.has_work():
                    self._lock.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception as e:  # step() contains forward failures; this is the last resort
                logger.exception("engine: iteration failed; failing every request")
                self._fail_all(e)

    def _fail_all(self, exc: BaseException) -> None:
        """End every running and waiting request with an error and clear the rows (without
        touching the cache rows one by one: after an unexpected failure they may be stale)."""
        with self._lock:
            seqs = list(self.running) + list(self.waiting)
            self.waiting.clear()
        self.running.clear()
        self._clear_rows()
        self._fail(seqs, exc)

    @torch.inference_mode()  # _fail_all() reaches here outside step()
    def _clear_rows(self) -> None:
        """Free every cache row at once (after the running list was emptied)."""
        self.cache.reset()

    def _fail(self, seqs: list[Sequence], exc: BaseException, error: str | None = None) -> None:
        """Finish each still-unfinished ``seqs`` with ``"error"``, recording ``exc`` and the
        one-line ``error`` (default: the exception's type and first line); their rows must
        already be gone from :attr:`running`."""
        for seq in seqs:
            if not seq.done.is_set():
                seq.exception = exc
                seq.error = error or f"engine: {_one_line(exc)}"
                self._finish(seq, "error")

    def drain(self, timeout: float | None = None) -> bool:
        """Stop admitting new requests and wait until every queued and running request has
        finished (at most ``timeout`` seconds). Returns True when nothing is left."""
        with self._lock:
            self._closed = True
        end = None if timeout is None else time.monotonic() + timeout
        while self.has_work():
            if end is not None and time.monotonic() >= end:
                return False
            if self._thread is None:
                self.step()
            else:
                time.sleep(0.01)
        return True

    def stop(self) -> None:
        """Close, stop the loop thread and cancel whatever is still queued or running."""
        with self._lock:
            self._closed = True
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for seq in list(self.running) + list(self.waiting):
            seq.cancel()
        self._reap()

    # ------------------------------------------------------------ iteration
    @torch.inference_mode()
    def step(self) -> None:
        """One iteration: reap, admit (prefill), then one batched decode step. An exception
        in a prefill or decode ends the requests it concerns with ``"error"`` (module
        docstring) and is logged with its traceback; ``step`` itself does not raise for it."""
        self._reap()
        self._admit()
        if self.running:
            try:
                self._decode()
            except Exception as e:
                logger.exception("engine: decode step failed; failing the running requests")
                self._fail_all_running(e)
        self.stats.steps += 1

    def _fail_all_running(self, exc: BaseException) -> None:
        seqs = list(self.running)
        self.running.clear()
        self._clear_rows()
        self._fail(seqs, exc)

    def _reap(self) -> None:
        now = time.monotonic()

        def expired(s: Sequence) -> bool:
            t = s.params.timeout_s
            return t is not None and now - s.arrival > t

        with self._lock:
            gone = [s for s in self.waiting if s._cancelled or expired(s)]
            for s in gone:
                self.waiting.remove(s)
        for s in gone:
            self._finish(s, "cancelled" if s._cancelled else "timeout")
        for i in range(len(self.running) - 1, -1, -1):
            s = self.running[i]
            if s._cancelled or expired(s):
                self._remove_row(i)
                self._finish(s, "cancelled" if s._cancelled else "timeout")

    def _admit(self) -> None:
        """Move waiting requests into free rows (FIFO) while their padded prompt tokens fit
        ``prefill_tokens`` (at least one request always fits), and prefill them."""
        batch: list[Sequence] = []
        longest = 0
        with self._lock:
            while self.waiting and len(self.running) + len(batch) < self.max_batch:
                n = len(self.waiting[0].prompt_ids)
                if batch and (len(batch) + 1) * max(longest, n) > self.prefill_tokens:
                    break
                batch.append(self.waiting.popleft())
                longest = max(longest, n)
        if batch:
            self._prefill_contained(batch)

    def _prefill_contained(self, batch: list[Sequence]) -> None:
        """:meth:`_prefill` ``batch``; when that raises, undo its rows and prefill its
        requests one at a time, so only those that fail alone end with an error (a request
        that already emitted a token is not replayed: it ends with the error)."""
        lo = len(self.running)
        try:
            self._prefill(batch)
            return
        except Exception as e:
            exc = e
        for row in range(len(self.running) - 1, lo - 1, -1):
            if self.running[row] in batch:
                self._remove_row(row)
        if self.cache is not None:
            for row in range(len(self.running), min(lo + len(batch), self.max_batch)):
                self.cache.release(row)
        if len(batch) == 1:
            logger.error("engine: prefill failed; failing its request", exc_info=exc)
            self._fail(batch, exc)
            return
        logger.warning("engine: a batched prefill failed (%s); retrying alone", _one_line(exc))
        retry = [s for s in batch if not s.done.is_set() and not s.output_ids]
        self._fail([s for s in batch if s not in retry], exc)
        for seq in retry:
            self._prefill_contained([seq])

    def _prefill(self, batch: list[Sequence]) -> None:
        """One forward pass over the new prompts, right-padded to the longest, each into its
        own fresh row (padding is masked out of attention and the MoE statistics; the rows
        are then trimmed to their real lengths, so decoding overwrites the padding)."""
        lo, m = len(self.running), len(batch)
        lens = [len(s.prompt_ids) for s in batch]
        S = max(lens)
        ids = torch.tensor([s.prompt_ids + [0] * (S - n) for s, n in zip(batch, lens, strict=True)],
                           device=self.device)  # fmt: skip
        mask = None
        if min(lens) < S:
            mask = (
                torch.arange(S, device=self.device)
                < torch.tensor(lens, device=self.device)[:, None]
            )
        for row in range(lo, lo + m):
            self.cache.release(row)
        self.cache.select(lo, lo + m)
        last = torch.tensor([n - 1 for n in lens], device=self.device)
        with serving_routing(self._batching):
            out = self.model(ids, mask=mask, kv_cache=self.cache, start_pos=0, logits_at=last)
        for i, n in enumerate(lens):
            self.cache.trim(lo + i, n)
        logits = out.logits[:, 0]
        experts = self._routing(out.records, [i * S + n - 1 for i, n in enumerate(lens)], batch)
        self._start(batch, logits, experts)

    def _start(self, batch: list[Sequence], logits: Tensor, experts: list) -> None:
        """Append prefilled ``batch`` to the running rows and accept their first tokens."""
        lo = len(self.running)
        self.stats.prompt_tokens += sum(len(s.prompt_ids) for s in batch)
        self.running.extend(batch)
        tokens = self._sample(logits, batch)
        for i in range(len(batch) - 1, -1, -1):  # backwards, as in _decode
            self._accept(lo + i, batch[i], tokens[i], experts[i])

    def _decode(self) -> None:
        seqs = list(self.running)
        n = len(seqs)
        x = torch.tensor([[s.output_ids[-1]] for s in seqs], device=self.device)
        lengths = self.cache.lengths[:n]
        # grow the cache here, one position ahead: a compiled decode then never takes the
        # growth branch, nor sees a view that spans the whole buffer (both recompile)
        self.cache.reserve(min(max(lengths) + 2, self.cache.max_len))
        # rows at one position take the cheaper shared-position path (same maths)
        same = all(x == lengths[0] for x in lengths)
        starts = lengths[0] if same else torch.tensor(lengths, device=self.device)
        self.cache.select(0, n)
        with serving_routing(self._batching):
            out = self._decode_model(x, kv_cache=self.cache, start_pos=starts)
        experts = self._routing(out.records, list(range(n)), seqs)
        tokens = self._sample(out.logits[:, -1], seqs)
        for i in range(n - 1, -1, -1):  # backwards: removing row i only moves a later row
            self._accept(i, seqs[i], tokens[i], experts[i])

    # --------------------------------------------------------------- pieces
    def _sample(self, logits: Tensor, seqs: list[Sequence]) -> list[int]:
        """Next token per row ``logits [n, V]``: batched argmax for greedy rows, each other
        row with its own settings and generator (so a row's draws do not depend on its
        neighbours). A row that cannot be sampled (non-finite logits, or its sampling
        raised) gets -1 and its :attr:`Sequence.error`; the other rows are unaffected."""
        # A row's sum is finite only if every logit is (NaN and ±inf propagate): one reduction
        # instead of an elementwise test over the vocabulary; an overflowed sum is re-checked.
        finite = torch.isfinite(logits.sum(dim=-1)).tolist()
        if not all(finite):
            finite = torch.isfinite(logits).all(dim=-1).tolist()
        if not all(finite):  # NaN/inf weights: those rows fail instead of sampling garbage
            for s, ok in zip(seqs, finite, strict=True):
                if not ok:
                    s.error = (
                        f"position {len(s.prompt_ids) + len(s.output_ids)}: the model's logits "
                        "are not finite; its weights or activations hold NaN or inf"
                    )
            out = self._sample(logits.nan_to_num(), seqs)
            return [t if ok else -1 for t, ok in zip(out, finite, strict=True)]
        out = [0] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        if len(greedy) == len(seqs):
            return logits.argmax(dim=-1).tolist()
        if greedy:
            picks = logits[greedy].argmax(dim=-1).tolist()
            for i, t in zip(greedy, picks, strict=True):
                out[i] = t
        for i, s in enumerate(seqs):
            if not s.params.greedy:
                p = s.params
                try:  # one request's settings must not fail its neighbours
                    tok = sample_next(
                        logits[i : i + 1],
                        temperature=p.temperature,
                        top_k=p.top_k,
                        top_p=p.top_p,
                        generator=s._generator,
                    )
                    out[i] = int(tok.item())
                except Exception as e:
                    logger.exception("engine: sampling failed for one request")
                    s.exception = e
                    s.error = f"sampling: {_one_line(e)}"
                    out[i] = -1
        return out

    def _routing(
        self, records: list, positions: list[int], seqs: list[Sequence]
    ) -> list[list[list[int]] | None]:
        """Per sequence, the experts of every MoE layer at ``positions`` (flat token index
        of the forward pass), when it asked for them; also feeds ``stats.expert_counts``."""
        recs = [r for r in records if r is not None]
        if recs and self.track_experts:
            self._count_experts([r.counts.tolist() for r in recs])  # each layer its own E
        wanted = [s.params.routing for s in seqs]
        result: list[list[list[int]] | None] = [None] * len(seqs)
        if not recs or not any(wanted):
            return result
        where = {p: i for i, p in enumerate(positions) if wanted[i]}
        for i in where.values():
            result[i] = [[] for _ in recs]
        for layer, r in enumerate(recs):
            tok = r.all_token_idx.tolist()
            exp = r.all_expert_idx.tolist()
            for t, e in zip(tok, exp, strict=True):
                i = where.get(t)
                if i is not None:
                    result[i][layer].append(e)
        return result

    def _accept(self, row: int, seq: Sequence, token: int, experts) -> None:
        """Append ``token`` to ``seq`` (row ``row``), emit it, and finish the sequence when a
        stop id/string, ``max_tokens`` or the context length says so."""
        now = time.monotonic()
        if seq.first_token_at is None:
            seq.first_token_at = now
        p = seq.params
        if token < 0:  # _sample set seq.error
            self._remove_row(row)
            self._finish(seq, "error")
            return
        if token in p.stop_ids:
            self._remove_row(row)
            self._finish(seq, "stop")
            return
        seq.output_ids.append(token)
        self.stats.generated_tokens += 1
        text, token_text, stopped = "", "", False
        if seq._detok is not None:
            text, token_text, stopped = seq._detok.push(token)
        if seq.sink is not None:
            seq.sink(TokenEvent(token, text, token_text, experts))
        reason = None
        if stopped:
            reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or (
            len(seq.prompt_ids) + len(seq.output_ids) >= self.max_seq_len + 1
        ):
            reason = "length"
        if reason is not None:
            self._remove_row(row)
            self._finish(seq, reason)

    @torch.inference_mode()  # stop() reaches here outside step()
    def _remove_row(self, row: int) -> None:
        last = len(self.running) - 1
        if row < last:
            self.running[row] = self.running[last]
            self.cache.move(last, row)
        else:
            self.cache.release(row)
        self.running.pop()

    def _count_experts(self, counts: list[list[int]]) -> None:
        """Add one forward's routed (token, expert) pairs per MoE layer to the stats (the
        caller checks ``track_experts``: the counts cost a reduction per layer)."""
        for acc, c in zip(self.stats.expert_counts, counts, strict=True):
            for e, v in enumerate(c):
                acc[e] += v

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.finished_at = time.monotonic()
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        tail = seq._detok.flush() if seq._detok is not None else ""
        if seq.sink is not None:
            seq.sink(FinishEvent(reason, tail))
        seq.done.set()


def _one_line(exc: BaseException) -> str:
    """``"Type: first line of the message"`` of an exception."""
    text = str(exc).splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
