"""The GeoFacts editing benchmark as a recipe for :func:`moelab.methods.runner.run_seeds`:
one arm per method, LiveEdit's chunked protocol [C] with one chunk of ``n_edits`` edits.

Per seed (shared by the arms, so they are paired): the stream
(:func:`~moelab.methods.editing.geofacts.geofacts_stream`), the states entering the edited
block for every evaluation prompt, and the unedited model's argmax on the locality prompts
(the pre-edit pass). Per arm: apply the whole stream one edit at a time, score every set,
time the evaluation pass edited and restored (inference latency overhead), restore, and
check that the restored model equals the original bit for bit.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from torch import Tensor

from moelab.errors import InvalidValueError
from moelab.methods.editing.config import EditConfig
from moelab.methods.editing.editor import Editor
from moelab.methods.editing.evaluate import PromptSet, predict, prompt_set
from moelab.methods.editing.geofacts import GeoFactsStream, geofacts_stream
from moelab.methods.editing.metrics import edit_score, token_accuracy
from moelab.methods.editing.requests import tokenize_edit


def load_model(source: str):
    """``(model in eval mode, tokenizer)`` of a named pretrained causal LM or a model folder.

    Raises:
        InvalidValueError: neither a known pretrained name nor an existing folder.
    """
    from moelab.data import load_tokenizer
    from moelab.interop.pretrained import PRETRAINED, load_pretrained
    from moelab.models import load_model as load_folder

    if source.lower() in PRETRAINED:
        return load_pretrained(source, kind="causal_lm")
    if not Path(source).is_dir():
        raise InvalidValueError(f"model: {source!r} is neither a pretrained name nor a folder")
    return load_folder(source).eval(), load_tokenizer(source)


class _SeedData:
    """One seed's stream and its cached evaluation prompts."""

    def __init__(self, model, tokenizer, config: EditConfig, seed: int, start_block: int) -> None:
        stream = geofacts_stream(
            tokenizer, seed, config.n_edits, config.n_neighbours, config.negatives
        )
        self.stream: GeoFactsStream = stream
        max_len = model.cfg.max_seq_len
        tok = [tokenize_edit(r, tokenizer, max_len) for r in stream.edits]
        gen = [tokenize_edit(r, tokenizer, max_len) for g in stream.generality for r in g]

        def prompts(texts: list[str]) -> tuple[list[Tensor], list[Tensor]]:
            seqs = [torch.tensor(tokenizer.encode(t), dtype=torch.long) for t in texts]
            return seqs, [torch.tensor([len(s) - 1]) for s in seqs]

        self.rel = prompt_set(
            model, [e.input_ids for e in tok], [e.positions for e in tok], start_block
        )
        self.rel_targets = [e.targets for e in tok]
        self.gen = prompt_set(
            model, [e.input_ids for e in gen], [e.positions for e in gen], start_block
        )
        self.gen_targets = [e.targets for e in gen]
        self.nb = prompt_set(
            model, *prompts([p for ps in stream.neighbours for p in ps]), start_block
        )
        self.sub = prompt_set(model, *prompts(stream.subject), start_block)
        self.nb_before = predict(model, self.nb)
        self.sub_before = predict(model, self.sub)
        self.negatives = prompts(stream.negatives)[0]

    @property
    def all_sets(self) -> list[PromptSet]:
        return [self.rel, self.gen, self.nb, self.sub]


class TimeEditingRecipe:
    """GeoFacts lifelong editing (``method`` picks the arm); see the module docstring."""

    name = "time"

    def __init__(self) -> None:
        self._model: tuple[str, object, object] | None = None
        self._seeds: dict[tuple, _SeedData] = {}

    def _load(self, source: str):
        if self._model is None or self._model[0] != source:
            model, tokenizer = load_model(source)
            self._model, self._seeds = (source, model, tokenizer), {}
        return self._model[1], self._model[2]

    def _timed_pass(self, model, sets: list[PromptSet], repeats: int) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for s in sets:
                predict(model, s)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def run(self, config: EditConfig, seed: int) -> dict[str, float]:
        model, tokenizer = self._load(config.model)
        torch.manual_seed(seed)
        before = {n: p.detach().clone() for n, p in model.state_dict().items()}
        editor = Editor(model, config)
        key = (config.n_edits, config.n_neighbours, config.negatives, config.layer, seed)
        if key not in self._seeds:
            self._seeds[key] = _SeedData(model, tokenizer, config, seed, editor.start_block)
        data = self._seeds[key]
        if config.method == "time":
            editor.set_negatives(data.negatives)
        editor.apply_stream(data.stream.edits, tokenizer)
        if editor.bank is not None:
            editor.site.reset_telemetry()
        rel = token_accuracy(predict(model, data.rel), data.rel_targets)
        gen = token_accuracy(predict(model, data.gen), data.gen_targets)
        loc_nb = token_accuracy(predict(model, data.nb), data.nb_before)
        loc_sub = token_accuracy(predict(model, data.sub), data.sub_before)
        edited_s = self._timed_pass(model, data.all_sets, config.latency_repeats)
        fired = float(editor.site.fire_counts.sum()) if editor.bank is not None else 0.0
        edit_seconds = statistics.mean(editor.edit_seconds)
        params = editor.params_per_edit
        editor.restore()
        base_s = self._timed_pass(model, data.all_sets, config.latency_repeats)
        after = model.state_dict()
        exact = float(
            before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        )
        tokens = sum(int(b[1].sum()) for s in data.all_sets for b in s.batches)
        return {
            "reliability": rel,
            "generality": gen,
            "locality_neighbour": loc_nb,
            "locality_subject": loc_sub,
            "score": edit_score(rel, gen, loc_nb, loc_sub),
            "params_per_edit": float(params),
            "edit_seconds": edit_seconds,
            "latency_overhead_pct": 100.0 * (edited_s / base_s - 1.0),
            "fired_token_fraction": fired / (tokens * (1 + config.latency_repeats)),
            "restore_exact": exact,
        }
