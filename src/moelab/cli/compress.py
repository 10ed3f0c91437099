"""``moelab compress RUN --lossless --out DIR``: write the lossless expert store (ZipMoE).

The store holds the dense weights, the experts' exponent chunks (zstd or ANS) and raw
sign-mantissa bytes in one pack with an index, the tokenizer, and a routing profile for the
offload cache planner. ``moelab generate DIR --offload --cache-mb N`` and ``moelab eval DIR
--offload --cache-mb N`` serve from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moelab.cli._app import Opt, app, console, guarded
from moelab.cli._common import load_run
from moelab.cli._ranges import Range
from moelab.errors import InvalidValueError


@app.command()
def compress(
    run: Annotated[Path, typer.Argument(help="Run or model folder to compress.")],
    out: Annotated[Path, Opt(help="Store folder to write.")],
    lossless: Annotated[
        bool, Opt(help="Lossless expert store (bf16/fp32 bit-field split + entropy coding).")
    ] = False,
    dtype: Annotated[
        str | None, Opt(help="Cast the model first: bf16 or fp32 (default: keep its dtype).")
    ] = None,
    codec: Annotated[
        str,
        Opt(
            help="Exponent codec: zstd (the ZipMoE authors' config default; fast, "
            "multi-threaded decode), lz4hc (LZ4HC level 9, the authors' evaluation codec: "
            "larger, decodes ~2x faster than zstd), lz4 (LZ4 fast), ans (at the entropy bound, ~3 % smaller stores, but ~25x slower to decode "
            "and serial), best (the smaller per tensor), or raw (uncompressed)."
        ),
    ] = "zstd",
    chunks: Annotated[
        int, Opt(help="Independently decodable exponent chunks per tensor."), Range(min=1)
    ] = 5,
    profile_data: Annotated[
        str, Opt(help="Corpus whose routing the cache planner profiles (name or path).")
    ] = "shakespeare",
    profile_tokens: Annotated[
        int, Opt(help="Tokens to profile (0 = no profile)."), Range(min=0)
    ] = 1024,
    profile_seq_len: Annotated[int, Opt(help="Tokens per profiled sequence."), Range(min=1)] = 128,
    overwrite: Annotated[bool, Opt(help="Replace an existing store folder.")] = False,
    as_json: Annotated[bool, Opt("--json", help="Print JSON.")] = False,
) -> None:
    """Write a run's experts to a lossless store for offloaded inference.

    Examples:
      moelab compress runs/main --lossless --out runs/main-zip --dtype bf16
      moelab compress runs/smollm2-moe --lossless --out runs/smol-zip --dtype bf16 --codec zstd
    """
    report = guarded(
        _compress, run, out, lossless, dtype, codec, chunks, profile_data, profile_tokens,
        profile_seq_len, overwrite,
    )  # fmt: skip
    if as_json:
        console.print_json(json.dumps(report.to_dict()))
        return
    table = Table(title=f"{out}: lossless expert store ({report.dtype}, codec {report.codec})")
    for col in ("tensor", "elements", "original MB", "stored MB", "% of original",
                "exp bits/elt", "entropy bits/elt", "exp / entropy", "codecs"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("tensor", "codecs") else "right")
    for name, k in report.kinds.items():
        exp_bits = 8 * k.exponent / max(k.elements, 1)
        h = 8 * k.entropy_bound / max(k.elements, 1)
        table.add_row(
            name, f"{k.elements:,}", f"{k.original / 1e6:.2f}", f"{k.stored / 1e6:.2f}",
            f"{100 * k.stored / max(k.original, 1):.1f}", f"{exp_bits:.3f}", f"{h:.3f}",
            f"{exp_bits / h:.3f}" if h else "-",
            ", ".join(f"{c}×{n}" for c, n in sorted(k.codecs.items())),
        )  # fmt: skip
    console.print(table)
    console.print(f"dense weights {report.dense_bytes / 1e6:.2f} MB; {report.seconds:.1f} s")


def _compress(run, out, lossless, dtype, codec, chunks, profile_data, profile_tokens,
              profile_seq_len, overwrite):  # fmt: skip
    from moelab.compress.lossless import compress_model, copy_run_files
    from moelab.compress.lossless.store import is_store
    from moelab.models.quantized import is_quantized
    from moelab.serve.offload.trace import record_trace
    from moelab.utils.outdir import check_output_folder

    if not lossless:
        raise InvalidValueError(
            "compress: pass --lossless (the only compression this command writes)"
        )
    if profile_tokens < 0 or profile_seq_len < 1:
        raise InvalidValueError(
            f"profile_tokens: must be >= 0 and profile_seq_len >= 1, got {profile_tokens}, "
            f"{profile_seq_len}"
        )
    if is_store(run):
        raise InvalidValueError(
            f"{run}: already a lossless expert store (compress the run it came from)"
        )
    check_output_folder(out, inputs=[run], overwrite=overwrite)
    model, tokenizer = load_run(run)
    if is_quantized(model):  # the store holds float bit fields; codes would never load back
        raise InvalidValueError(
            f"{run}: a quantized model cannot go into a lossless store; compress the "
            "full-precision run"
        )
    if dtype is not None:
        from moelab.compress.lossless.model_store import DTYPES

        if dtype not in DTYPES:
            raise InvalidValueError(f"dtype: must be bf16 or fp32, got {dtype!r}")
        model = model.to(DTYPES[dtype])
    trace = None
    if profile_tokens:
        seq_len = min(profile_seq_len, model.cfg.max_seq_len)
        trace = record_trace(
            model, _profile_sequences(tokenizer, profile_data, profile_tokens, seq_len)
        )
    copy = copy_run_files(run)

    def extras(tmp: Path) -> None:
        copy(tmp)
        if not (tmp / "tokenizer_meta.json").exists():
            tokenizer.save(tmp)

    return compress_model(
        model, out, codec=codec, chunks=chunks, trace=trace, overwrite=overwrite,
        save_extras=extras,
    )  # fmt: skip


def _profile_sequences(tokenizer, corpus: str, tokens: int, seq_len: int):
    """Consecutive ``seq_len``-token windows of ``corpus``, ``tokens`` in all."""
    from moelab.data import TokenStream, load_corpus

    docs = load_corpus(corpus, max_bytes_per_domain=max(16 * tokens, 65536))
    stream = TokenStream.from_documents(docs, tokenizer, name=corpus)
    ids = stream.ids[: max(seq_len, tokens)]
    return [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
