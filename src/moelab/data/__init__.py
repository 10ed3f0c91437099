"""Data: real offline corpora, deterministic splits, tokenizers and LM batches.

Typical use::

    docs = load_corpus("mix", max_bytes_per_domain=2_000_000)
    train_docs, val_docs = split_documents(docs, val_fraction=0.05, seed=0)
    tok = ByteTokenizer()  # or BPETokenizer.train([d.text for d in train_docs], 4096)
    tok.save(run_dir)  # later: load_tokenizer(run_dir)
    names = sorted({d.domain for d in docs})
    train = TokenStream.from_documents(train_docs, tok, domain_names=names, name="train")
    val = TokenStream.from_documents(val_docs, tok, domain_names=names, name="val")
    batch = sample_batch(train, 32, 256, generator)
    for b in eval_batches(val, 32, 256, max_tokens=200_000): ...

Labelled text for classification and continual-learning recipes (:mod:`moelab.data.labelled`,
:mod:`~moelab.data.wordnet`, :mod:`~moelab.data.fortunes`) and country facts for editing
(:mod:`moelab.data.facts`)::

    ds = load_wordnet_supersenses()  # LabelledText: texts, labels, label_names, source
    for text, label in load_fortunes(min_entries=100): ...
    facts = load_country_facts()  # [Fact("Afghanistan", "capital", "Kabul"), ...]

Expression (cells × genes) for the flow-matching recipe (:mod:`moelab.data.expression`,
:mod:`moelab.data.singlecell`; .h5ad files need h5py)::

    table = load_expression("cells.h5ad")  # or load_pbmc68k_reduced(), or a .csv
    data = build_slides(table, tissue_key="tissue", seed=0)  # train/test slides, paired view
"""

from moelab.data.batching import (
    Batch,
    EvalCoverage,
    TokenStream,
    eval_batches,
    eval_coverage,
    sample_batch,
)
from moelab.data.corpora import PACKAGED_CORPORA, Document, load_corpus
from moelab.data.encoder_tokenizer import EncoderTokenizer
from moelab.data.errors import CorpusError, CorpusNotInstalledError, DataError, TokenizerError
from moelab.data.expression import ExpressionTable, load_expression
from moelab.data.facts import Fact, load_country_facts
from moelab.data.fortunes import load_fortunes
from moelab.data.labelled import LabelledText, load_kjv_verses, load_stdlib_modules
from moelab.data.singlecell import SlideData, Slides, build_slides, load_pbmc68k_reduced
from moelab.data.split import split_documents
from moelab.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    make_tokenizer,
)
from moelab.data.wordnet import load_wordnet_hypernyms, load_wordnet_supersenses

__all__ = [
    "PACKAGED_CORPORA",
    "BPETokenizer",
    "Batch",
    "ByteTokenizer",
    "CorpusError",
    "CorpusNotInstalledError",
    "DataError",
    "Document",
    "EncoderTokenizer",
    "EvalCoverage",
    "ExpressionTable",
    "Fact",
    "LabelledText",
    "SlideData",
    "Slides",
    "TokenStream",
    "Tokenizer",
    "TokenizerError",
    "build_slides",
    "eval_batches",
    "eval_coverage",
    "load_corpus",
    "load_country_facts",
    "load_expression",
    "load_fortunes",
    "load_kjv_verses",
    "load_pbmc68k_reduced",
    "load_stdlib_modules",
    "load_tokenizer",
    "load_wordnet_hypernyms",
    "load_wordnet_supersenses",
    "make_tokenizer",
    "sample_batch",
    "split_documents",
]
