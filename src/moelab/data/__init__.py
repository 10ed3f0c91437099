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
from moelab.data.split import split_documents
from moelab.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    make_tokenizer,
)

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
    "TokenStream",
    "Tokenizer",
    "TokenizerError",
    "eval_batches",
    "eval_coverage",
    "load_corpus",
    "load_tokenizer",
    "make_tokenizer",
    "sample_batch",
    "split_documents",
]
