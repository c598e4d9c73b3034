"""``python -m mmm.data prepare``: text files -> token files for ``--dataset bin``.

    python -m mmm.data prepare --tokenizer tokenizer.json --out data/mine notes/*.txt
    python -m mmm.data prepare --tokenizer bytes --out data/bytes --val-fraction 0.05 book.txt

Each input file is one document (a directory: its ``*.txt`` files, sorted), tokenised and followed
by the end-of-text id (the tokenizer's ``<|endoftext|>``, ``</s>``, ...; byte 0 for ``bytes``).
The token stream is cut in two: the last ``--val-fraction`` goes to ``val.bin``, the rest to
``train.bin``. ``meta.json`` records the dtype (uint16 when the vocabulary fits, else uint32),
the vocabulary, the end-of-text id, each split's token count and largest id; a tokenizer.json is
copied beside them, so the directory is self-contained.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mmm.cli import fraction, nonempty_text
from mmm.errors import ArgumentParser, UsageError
from mmm.faults import crash_point
from mmm.files import write_atomic

PROG = "python -m mmm.data prepare"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Tokenise text files into train.bin / val.bin / meta.json for the trainers' --dataset bin.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", nargs="+", metavar="FILE", help="text files (UTF-8), or directories of *.txt files")
    p.add_argument(
        "--out",
        required=True,
        type=nonempty_text,
        metavar="DIR",
        help="directory to write train.bin, val.bin, meta.json to",
    )
    p.add_argument(
        "--tokenizer",
        type=nonempty_text,
        default="bytes",
        metavar="PATH|bytes",
        help="a Hugging Face tokenizers tokenizer.json, or 'bytes' for UTF-8 bytes (vocab 256) [bytes]",
    )
    p.add_argument(
        "--val-fraction",
        type=fraction,
        default=0.1,
        help="share of the tokens (the last ones) written to val.bin; 0: no val.bin [0.1]",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "uint16", "uint32"],
        default="auto",
        help="token dtype; auto: uint16 when the vocabulary fits (<= 65536), else uint32 [auto]",
    )
    return p


def _input_files(inputs: Sequence[str]) -> list[Path]:
    files = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not found:
                raise UsageError(f"{name} is a directory with no *.txt files")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"{name} does not exist")
    return files


def _tokenise(files, tok, dtype, stream: Path, val_fraction: float) -> tuple[int, int, int]:
    """Every file's tokens to ``stream``, as they come (the corpus is never held whole); returns the count
    and its split (train, val)."""
    from mmm.data.tokens import encode_documents

    total = 0
    with open(stream, "wb") as f:  # tokens written as they come: the corpus is never held whole
        for file in files:
            try:
                text = file.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise UsageError(f"{file} is not UTF-8 text ({err.reason} at byte {err.start})") from None
            ids = encode_documents(tok, [text]).astype(dtype)
            ids.tofile(f)
            total += ids.size
    if total == 0:
        raise UsageError(f"{', '.join(map(str, files))}: no text to tokenise")
    n_val = math.ceil(total * val_fraction) if val_fraction > 0 else 0
    n_train = total - n_val
    if n_train < 2:  # not one window of a single token and its next
        raise UsageError(
            f"--val-fraction {val_fraction:g} leaves {n_train} of {total} tokens to train.bin: at least 2 are needed; "
            "give a smaller fraction, or more text"
        )
    return total, n_train, n_val


def prepare(
    inputs: Sequence[str | Path],
    out: str | Path,
    *,
    tokenizer: str = "bytes",
    val_fraction: float = 0.1,
    dtype: str = "auto",
) -> dict:
    """Tokenise ``inputs`` into ``out``/train.bin (+ val.bin) and meta.json; returns the meta."""
    from mmm.data.tokens import fingerprint, get_tokenizer, token_dtype

    if not 0 <= val_fraction < 1:
        raise UsageError(f"--val-fraction {val_fraction} must be in [0, 1)")
    files = _input_files([str(i) for i in inputs])
    tok = get_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size) if dtype == "auto" else dtype
    if np.iinfo(dtype).max < tok.vocab_size - 1:
        raise UsageError(
            f"--dtype {dtype} cannot hold the tokenizer's ids (vocabulary {tok.vocab_size}); use --dtype uint32 or auto"
        )
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a file; give a directory")
    made = [p for p in [out, *out.parents] if not p.exists()]  # the folders this makes, deepest first
    out.mkdir(parents=True, exist_ok=True)
    stream = out / ".tokens.tmp"
    try:
        total, n_train, n_val = _tokenise(files, tok, dtype, stream, val_fraction)
    except BaseException:  # refused, failed or interrupted: the temporary stream goes, and the folders made
        stream.unlink(missing_ok=True)
        for folder in made:
            if any(folder.iterdir()):
                break
            folder.rmdir()
        raise
    tokens = np.memmap(stream, dtype=dtype, mode="r")
    max_token = {"train": int(tokens[:n_train].max()) if n_train else None}
    # every file is written and on disk under a temporary name before any is renamed; meta.json goes last
    # and records each file's count and fingerprint, so a kill between the renames leaves files that
    # meta.json does not describe: refused at the next start, never read with the wrong meta
    written = {"train": _write(out / "train.bin", tokens[:n_train])}
    if n_val:
        max_token["val"] = int(tokens[n_train:].max())
        written["val"] = _write(out / "val.bin", tokens[n_train:])
    del tokens
    stream.unlink()
    fingerprints = {}
    for split, tmp in written.items():
        fingerprints[split] = fingerprint(tmp)
        os.replace(tmp, out / f"{split}.bin")
    if not n_val and (out / "val.bin").exists():
        (out / "val.bin").unlink()  # from an earlier prepare into the same directory
    crash_point("prepare")
    for stale in (f"{s}.{d}.bin" for s in ("train", "val") for d in ("uint16", "uint32")):
        if (out / stale).exists():  # would make the split ambiguous
            (out / stale).unlink()
    meta = {
        "dtype": dtype,
        "vocab_size": tok.vocab_size,
        "tokenizer": tok.name,
        "eos_id": tok.eos_id,
        "eos_token": tok.eos_token,
        "tokens": {"train": n_train, "val": n_val},
        "fingerprints": fingerprints,
        "max_token": max_token,
        "documents": len(files),
    }
    if hasattr(tok, "path"):
        write_atomic(out / "tokenizer.json", Path(tok.path).read_bytes())
        meta["tokenizer"] = "tokenizer.json"
    else:  # an earlier prepare's tokenizer would be taken for these tokens' (an export ships it)
        (out / "tokenizer.json").unlink(missing_ok=True)
    write_atomic(out / "meta.json", json.dumps(meta, indent=1) + "\n")  # and the renames before it, on disk
    return meta


def _write(path: Path, tokens) -> Path:
    """``tokens`` in ``<path>.tmp``, on disk (fsync); the temporary file's path."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        tokens.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction, dtype=args.dtype)
    t = meta["tokens"]
    print(
        f"{args.out}: train.bin {t['train']} tokens, val.bin {t['val']} tokens ({meta['dtype']}, vocabulary "
        f"{meta['vocab_size']}, end-of-text id {meta['eos_id']}, {meta['documents']} documents)"
    )
    return 0
