"""Token data on disk: nanoGPT-style ``.bin`` token files and Hugging Face datasets saved with
``save_to_disk``, sampled as random windows of ``seq_len + 1`` tokens.

Each step's global batch draws its window starts from the (seed, step) generator, for the whole
batch; a data-parallel rank then reads only its rows (from a memory map: no full load). So the
windows are the same on any mesh, and resuming at a step restores the data position.

Token files (``--dataset bin --data-dir DIR``)::

    DIR/train.bin  DIR/val.bin     flat arrays of token ids, uint16 unless told otherwise
    DIR/meta.json                  optional: {"dtype": "uint16"|"uint32", "vocab_size": V, ...}
    DIR/meta.pkl                   optional (nanoGPT's): its vocab_size
    DIR/train.uint32.bin           the dtype in the name (instead of, or agreeing with, meta.json)

``python -m mmm.data prepare`` writes such a directory (with meta.json and the tokenizer).
numpy reads the files; ``datasets`` and ``tokenizers`` are imported only for Hugging Face data.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pickle
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mmm import env
from mmm.data.seeds import step_generator
from mmm.errors import UsageError
from mmm.files import write_atomic
from mmm.log import get_logger

DTYPES = ("uint16", "uint32")
# end-of-document tokens looked for in a tokenizer's vocabulary, in this order
EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")
BYTE_EOS = 0  # the byte-level "tokenizer" ends a document with byte 0, which text does not contain
_SCAN_CHUNK = 1 << 26  # tokens per chunk when scanning a file for its largest id


class TokenWindows:
    """Random windows of ``seq_len + 1`` tokens of a 1-D token array (a numpy memmap or array)."""

    def __init__(
        self, tokens, *, seq_len: int, name: str, source: str, vocab_size: int, max_token: int | None = None
    ) -> None:
        n = len(tokens)
        if n < seq_len + 1:
            fix = f"use --seq-len {n - 1} or less, or more data" if n >= 2 else "give it more data"
            raise UsageError(f"{source} holds {n} tokens, fewer than one window of --seq-len {seq_len} + 1; {fix}")
        top = int(max_token) if max_token is not None else largest_token(tokens)
        if top >= vocab_size:
            raise UsageError(
                f"{source}: token id {top} >= --vocab-size {vocab_size}; the model's vocabulary must "
                f"hold every token id: pass --vocab-size {top + 1} or more (or record the tokenizer's "
                "vocab_size in meta.json)"
            )
        self.tokens, self.seq_len, self.name, self.source = tokens, seq_len, name, source
        self.vocab_size, self.max_token = vocab_size, top

    def __len__(self) -> int:
        return len(self.tokens)

    def global_batch(self, seed: int, step: int, batch: int, rows: slice = slice(None)) -> torch.Tensor:
        """Step ``step``'s global batch (``batch`` windows), or only its ``rows``: the starts are drawn
        for the whole batch, the tokens read for the rows asked."""
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (batch,), generator=step_generator(seed, step))
        idx = starts[rows].numpy()[:, None] + np.arange(self.seq_len + 1)
        return torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))


def largest_token(tokens) -> int:
    """The largest id in a token array, read in chunks (a memmap is never loaded whole)."""
    top = 0
    for i in range(0, len(tokens), _SCAN_CHUNK):
        top = max(top, int(tokens[i : i + _SCAN_CHUNK].max()))
    return top


# --------------------------------------------------------------------------- .bin token files
def check_data_dir(data_dir: str | Path | None, dataset: str) -> Path:
    if data_dir is None:
        raise UsageError(f"--dataset {dataset} reads a directory: add --data-dir DIR")
    path = Path(data_dir)
    if not path.exists():
        raise UsageError(f"--data-dir {str(path)!r} does not exist")
    if not path.is_dir():
        raise UsageError(f"--data-dir {str(path)!r} is a file; give the directory that holds it")
    return path


class _PlainUnpickler(pickle.Unpickler):
    """nanoGPT's meta.pkl is dicts, strings and numbers: anything that names a class is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a meta.pkl")


def read_meta(data_dir: Path) -> dict:
    """``meta.json`` of a token directory, else the vocab_size of a nanoGPT ``meta.pkl``, else {}."""
    file = data_dir / "meta.json"
    if file.is_file():
        try:
            meta = json.loads(file.read_text())
        except (ValueError, UnicodeDecodeError) as err:
            raise UsageError(f"{file} is not valid JSON ({err})") from None
        if not isinstance(meta, dict):
            raise UsageError(
                f"{file} holds a {type(meta).__name__}; expected an object such as "
                '{"dtype": "uint16", "vocab_size": 50257}'
            )
    elif (data_dir / "meta.pkl").is_file():
        file = data_dir / "meta.pkl"
        try:
            with open(file, "rb") as f:
                raw = _PlainUnpickler(f).load()
        except Exception as err:  # noqa: BLE001 - any unreadable pickle is the user's file
            raise UsageError(f"{file} could not be read ({err}); write a meta.json instead") from None
        meta = {"vocab_size": raw.get("vocab_size")} if isinstance(raw, dict) else {}
    else:
        return {}
    dtype = meta.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"{file}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    vocab = meta.get("vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or vocab < 1):
        raise UsageError(f"{file}: vocab_size {vocab!r} is not a positive integer")
    for key, what in (("tokens", "a count of tokens"), ("max_token", "the largest token id (or null)")):
        value = meta.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise UsageError(f'{file}: {key} {value!r} is not a map of split to {what}, e.g. {{"train": 1000}}')
        for split, n in value.items():
            if not (n is None and key == "max_token") and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise UsageError(f"{file}: {key}[{split!r}] {n!r} is not {what}; rerun python -m mmm.data prepare")
    return {**meta, "_file": str(file)}


FINGERPRINT_BYTES = 1 << 20  # a token file's fingerprint reads this much at each end


def fingerprint(path: Path) -> str:
    """A token file's size and a hash of its first and last MiB: what meta.json records of each split, so
    that a file cut short, or replaced by another ``prepare`` whose meta.json never came, is refused
    (reading 2 MiB, not the whole file, at every start)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(FINGERPRINT_BYTES))
        if size > FINGERPRINT_BYTES:
            f.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
            h.update(f.read())
    return f"{size}:{h.hexdigest()[:16]}"


def check_recorded(meta: dict, path: Path, split: str, tokens) -> None:
    """The split's token file is the one meta.json describes (its count and fingerprint, when recorded)."""
    fix = "copy it again, or rerun python -m mmm.data prepare"
    recorded = (meta.get("tokens") or {}).get(split)
    if recorded is not None and recorded != len(tokens):
        raise UsageError(
            f"{path} holds {len(tokens)} tokens but {meta['_file']} records {recorded} (a copy cut short, or a "
            f"prepare that did not finish): {fix}"
        )
    print_ = (meta.get("fingerprints") or {}).get(split)
    if print_ is not None and print_ != fingerprint(path):
        raise UsageError(
            f"{path} is not the file {meta['_file']} describes (its fingerprint differs: another prepare's "
            f"tokens, or a prepare that did not finish): {fix}"
        )


def bin_file(data_dir: Path, split: str) -> tuple[Path, str]:
    """The token file of ``split`` in ``data_dir`` and its dtype: from the name (``train.uint32.bin``),
    else meta.json's ``dtype``, else uint16 (nanoGPT's)."""
    meta = read_meta(data_dir)
    named = [(data_dir / f"{split}.{d}.bin", d) for d in DTYPES if (data_dir / f"{split}.{d}.bin").is_file()]
    plain = data_dir / f"{split}.bin"
    found = ([(plain, meta.get("dtype") or "uint16")] if plain.is_file() else []) + named
    if not found:
        raise UsageError(
            f"--data-dir {str(data_dir)!r} has no {split}.bin (nor {split}.uint16.bin / "
            f"{split}.uint32.bin); write one with: python -m mmm.data prepare --out {data_dir} FILES"
        )
    if len(found) > 1:
        raise UsageError(
            f"--data-dir {str(data_dir)!r} has {len(found)} token files for {split!r}: "
            f"{', '.join(p.name for p, _ in found)}; keep one"
        )
    path, dtype = found[0]
    if meta.get("dtype") and meta["dtype"] != dtype:
        raise UsageError(f"{path} is named {dtype} but {meta['_file']} says dtype {meta['dtype']!r}; make them agree")
    return path, dtype


def open_bin(path: Path, dtype: str):
    """A read-only numpy memmap of a token file (size checked against the dtype)."""
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size % itemsize:
        raise UsageError(
            f"{path} is {size} bytes, not a whole number of {dtype} tokens ({itemsize} bytes each); "
            "is its dtype right? (meta.json's dtype, or a name such as train.uint32.bin)"
        )
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def check_guessed_dtype(tokens, path: Path, vocab_size: int) -> None:
    """A plain ``train.bin`` with no recorded dtype is read as nanoGPT's uint16; refuse where that guess
    would train on garbage: a vocabulary uint16 cannot hold, or data that looks like uint32 (read as
    uint16, every second value is the zero high half of a small uint32 id)."""
    fix = (
        f'record its dtype in {path.parent / "meta.json"} ({{"dtype": "uint32"}} or {{"dtype": "uint16"}}) '
        f"or put it in the name ({path.stem}.uint32.bin)"
    )
    if vocab_size > 2**16:
        raise UsageError(
            f"{path} has no recorded dtype, so it would be read as uint16, but --vocab-size {vocab_size} has ids "
            f"above 65535 that uint16 cannot hold: {fix}"
        )
    sample = np.asarray(tokens[: min(len(tokens) - len(tokens) % 2, 1 << 20)])
    if len(sample) >= 64:
        high, low = sample[1::2], sample[0::2]
        if (high == 0).mean() > 0.9 and (low == 0).mean() < 0.5:
            raise UsageError(
                f"{path} has no recorded dtype and, read as uint16, every second value is 0: it looks like "
                f"uint32 tokens (their high halves); {fix}"
            )


def bin_tokens(data_dir, *, seq_len: int, vocab_size: int, split: str = "train") -> TokenWindows:
    """``--dataset bin``: windows of ``DIR/<split>.bin``."""
    data_dir = check_data_dir(data_dir, "bin")
    path, dtype = bin_file(data_dir, split)
    tokens = open_bin(path, dtype)
    meta = read_meta(data_dir)
    if path.name == f"{split}.bin" and not meta.get("dtype"):
        check_guessed_dtype(tokens, path, vocab_size)
    check_recorded(meta, path, split, tokens)
    # prepare records each split's largest id with its token count (checked above): a large file is not
    # scanned on every rank at every start
    recorded = (meta.get("max_token") or {}).get(split)
    if (meta.get("tokens") or {}).get(split) is None:
        recorded = None
    return TokenWindows(
        tokens,
        seq_len=seq_len,
        name=f"bin:{data_dir.name}/{path.name}",
        source=str(path),
        vocab_size=vocab_size,
        max_token=recorded,
    )


# --------------------------------------------------------------------------- tokenizers
class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256); a document ends with byte 0."""

    name = "bytes"
    vocab_size = 256
    eos_id = BYTE_EOS
    eos_token = "\\x00"

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]


class FileTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer.json; documents end with its end-of-text token (the
    first of :data:`EOS_TOKENS` in its vocabulary; none: documents are joined as they are)."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UsageError(f"--tokenizer {path} needs the tokenizers package: pip install 'mmm[data]'") from None
        if not path.is_file():
            raise UsageError(f"--tokenizer {str(path)!r} does not exist; give a tokenizer.json file, or 'bytes'")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - the user's file
            raise UsageError(f"--tokenizer {path} is not a tokenizers JSON file ({str(err).splitlines()[0]})") from None
        self.name, self.path = str(path), path
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.eos_token = next((t for t in EOS_TOKENS if t in vocab), None)
        self.eos_id = vocab[self.eos_token] if self.eos_token is not None else None

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]


def get_tokenizer(spec: str | None):
    """``bytes`` (or None) for byte-level, else a tokenizer.json path."""
    if spec in (None, "bytes"):
        return ByteTokenizer()
    path = Path(spec)
    return _file_tokenizer(path, path.stat().st_mtime_ns if path.is_file() else None)


@lru_cache(maxsize=4)
def _file_tokenizer(path: Path, mtime_ns: int | None) -> FileTokenizer:  # read again when the file changes
    return FileTokenizer(path)


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def encode_documents(tokenizer, texts: list[str]):
    """One numpy array of the texts' tokens, each document followed by the end-of-text id."""
    dtype = token_dtype(tokenizer.vocab_size)
    parts = []
    for ids in tokenizer.encode(texts):
        parts.append(np.asarray(ids, dtype=dtype))
        if tokenizer.eos_id is not None:
            parts.append(np.asarray([tokenizer.eos_id], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


# --------------------------------------------------------------------------- Hugging Face datasets
HF_SPLITS = {"train": ("train",), "val": ("val", "validation", "valid", "test")}


def _load_hf_split(data_dir: Path, split: str):
    try:
        import datasets
    except ImportError:
        raise UsageError("--dataset hf needs the datasets package: pip install 'mmm[data]'") from None
    try:
        loaded = datasets.load_from_disk(str(data_dir))
    except FileNotFoundError as err:
        raise UsageError(
            f"--data-dir {str(data_dir)!r} is not a dataset saved with save_to_disk() ({str(err).splitlines()[0]})"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        for key in HF_SPLITS.get(split, (split,)):
            if key in loaded:
                return loaded[key], key
        raise UsageError(f"--data-dir {str(data_dir)!r} has no {split!r} split (it has: {', '.join(loaded)})")
    if split != "train":
        raise UsageError(
            f"--data-dir {str(data_dir)!r} holds one dataset, no {split!r} split; save a DatasetDict "
            "with train and validation splits"
        )
    return loaded, None


def hf_token_array(
    data_dir,
    *,
    split: str = "train",
    text_column: str | None = None,
    tokenizer: str | None = None,
    batch_rows: int = 1000,
):
    """The token stream of a saved dataset's split: a text column tokenised (documents joined with
    the end-of-text id), or a pre-tokenised column (lists of ids, e.g. ``input_ids``) as it is.
    Returns (tokens, description)."""
    data_dir = check_data_dir(data_dir, "hf")
    ds, key = _load_hf_split(data_dir, split)
    columns = list(ds.column_names)
    column = text_column or ("input_ids" if "input_ids" in columns else "text")
    if column not in columns:
        raise UsageError(
            f"--data-dir {str(data_dir)!r} has no column {column!r} (it has: {', '.join(columns)}); "
            "name the text with --text-column"
        )
    source = f"{data_dir}{'[' + key + ']' if key else ''}:{column}"
    if len(ds) == 0:
        return np.zeros(0, dtype=np.uint16), source
    first = ds[0][column]
    parts = []
    if isinstance(first, str):
        tok = get_tokenizer(tokenizer)
        for batch in ds.select_columns([column]).iter(batch_size=batch_rows):
            parts.append(encode_documents(tok, batch[column]))
    elif isinstance(first, (list, tuple)) or hasattr(first, "__array__"):
        for batch in ds.select_columns([column]).iter(batch_size=batch_rows):
            parts += [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in batch[column]]
    else:
        raise UsageError(
            f"{source}: column {column!r} holds {type(first).__name__} values; expected text or lists of token ids"
        )
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if tokens.size and tokens.min() < 0:
        raise UsageError(f"{source}: token id {int(tokens.min())} is negative")
    if tokens.dtype == np.int64 and tokens.size and tokens.max() < 2**32:  # pre-tokenised: keep it compact
        tokens = tokens.astype(token_dtype(int(tokens.max()) + 1))
    return tokens, source


def hf_tokens(
    data_dir,
    *,
    seq_len: int,
    vocab_size: int,
    split: str = "train",
    text_column: str | None = None,
    tokenizer: str | None = None,
) -> TokenWindows:
    """``--dataset hf``: windows of a saved dataset's token stream. In a job of several ranks the stream
    is tokenised once, by rank 0, into a token file every rank memory-maps (:func:`cached_hf_tokens`):
    a rank holds a window at a time, not the corpus (tokenising on every rank took ~36 bytes per token
    per rank: ~290 GB per node of 8 ranks for a 2B-token split)."""
    tokens, source = cached_hf_tokens(data_dir, split=split, text_column=text_column, tokenizer=tokenizer)
    return TokenWindows(tokens, seq_len=seq_len, name=f"hf:{Path(data_dir).name}", source=source, vocab_size=vocab_size)


TOKEN_CACHE = ".mmm-tokens"  # beside the dataset (shared by every node), else MMM_TOKEN_CACHE


def token_cache_dir(data_dir: Path) -> Path:
    """Where tokenised splits are kept: ``MMM_TOKEN_CACHE``, else ``<data-dir>/.mmm-tokens`` when the
    dataset's folder is writable, else ``~/.cache/mmm/tokens``."""
    if env.is_set("MMM_TOKEN_CACHE"):
        return Path(env.get("MMM_TOKEN_CACHE"))
    if os.access(data_dir, os.W_OK):
        return data_dir / TOKEN_CACHE
    return Path.home() / ".cache" / "mmm" / "tokens"


def _cache_key(data_dir: Path, split: str, text_column: str | None, tokenizer: str | None) -> str:
    """Names what the tokens depend on: the dataset's files (names, sizes, times), the column and the
    tokenizer (its file's size and time); any change gives another file."""
    h = hashlib.sha256()
    for f in sorted(p for p in data_dir.rglob("*") if p.is_file() and TOKEN_CACHE not in p.parts):
        st = f.stat()
        h.update(f"{f.relative_to(data_dir)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    h.update(f"{split}:{text_column}:{tokenizer}\n".encode())
    if tokenizer not in (None, "bytes") and Path(tokenizer).is_file():
        st = Path(tokenizer).stat()
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def cached_hf_tokens(data_dir, *, split: str = "train", text_column: str | None = None, tokenizer: str | None = None):
    """(tokens, description) of a split, as :func:`hf_token_array` gives them, read from a token file
    that rank 0 writes once (the other ranks wait, then memory-map it; a later job with the same data
    and tokenizer reuses it). A single process, or a rank that cannot see rank 0's file (a cache on a
    node-local disk), tokenises for itself."""
    data_dir = check_data_dir(data_dir, "hf")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return hf_token_array(data_dir, split=split, text_column=text_column, tokenizer=tokenizer)
    key = _cache_key(data_dir, split, text_column, tokenizer)
    cache = token_cache_dir(data_dir)
    path, meta = cache / f"{split}-{key}.bin", cache / f"{split}-{key}.json"
    # the outcome travels through the job's store, waited on without the collective timeout: tokenising a
    # large split on rank 0 may take longer than that
    store, note = dist.distributed_c10d._get_default_store(), f"mmm/tokens/{split}-{key}"
    if dist.get_rank() == 0:
        try:
            if not _holds_described(path, _description(meta)):
                _write_token_cache(path, meta, data_dir, split, text_column, tokenizer)
            outcome = ("ok", json.loads(meta.read_text()))
        except UsageError as e:
            outcome = ("error", str(e))
        except OSError as e:  # a cache folder it cannot write: every rank tokenises for itself
            outcome = ("none", f"{e}")
        except BaseException as e:
            store.set(note, json.dumps(("failed", f"{type(e).__name__}: {e}")))
            raise  # a real bug: its traceback, from rank 0
        store.set(note, json.dumps(outcome))
    else:
        store.wait([note], datetime.timedelta(days=7))
        outcome = tuple(json.loads(store.get(note)))
    kind, value = outcome
    if kind == "error":
        raise UsageError(value)
    if kind == "failed":
        raise RuntimeError(f"rank 0 failed to tokenise {data_dir}: {value}")
    if kind == "ok" and _holds_described(path, value):
        tokens = np.memmap(path, dtype=value["dtype"], mode="r") if value["tokens"] else np.zeros(0, value["dtype"])
        return tokens, value["source"]
    if dist.get_rank() == 0:
        reason = value if kind == "none" else f"{path} is not visible on every rank"
        get_logger().warning("token cache: %s; every rank tokenises %s itself", reason, data_dir)
    return hf_token_array(data_dir, split=split, text_column=text_column, tokenizer=tokenizer)


def _description(meta: Path) -> dict | None:
    """A token cache file's description (its ``.json``), or None where there is none to read."""
    try:
        return json.loads(meta.read_text())
    except (OSError, ValueError):
        return None


def _holds_described(path: Path, value: dict | None) -> bool:
    """Whether the token cache file is there and as long as its description says (a file cut short, by a
    full disk or a copy broken off, is written again by rank 0; a rank that cannot see it tokenises)."""
    try:
        return path.stat().st_size == int(value["tokens"]) * np.dtype(value["dtype"]).itemsize
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _write_token_cache(path: Path, meta: Path, data_dir: Path, split: str, text_column, tokenizer) -> None:
    """Rank 0: the split's tokens to ``path`` and their description to ``meta``, each written whole
    (a temporary name, fsynced, renamed), the tokens first: a meta file names only complete tokens."""
    tokens, source = hf_token_array(data_dir, split=split, text_column=text_column, tokenizer=tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    description = json.dumps({"dtype": str(tokens.dtype), "tokens": int(tokens.size), "source": source}).encode()
    for target, data in ((path, tokens.tofile), (meta, description)):
        write_atomic(target, data, tmp=target.with_name(f".{target.name}.{os.getpid()}.tmp"))


# --------------------------------------------------------------------------- vocabulary
def data_vocab_size(dataset: str, *, data_dir=None, tokenizer: str | None = None) -> tuple[int | None, str]:
    """The vocabulary the data declares, and where it says so: meta.json / meta.pkl of token files,
    the tokenizer of a Hugging Face dataset (byte-level: 256); (None, "") when it declares none
    (pre-tokenised data without a tokenizer: the largest id is checked at load)."""
    if dataset == "bin":
        meta = read_meta(check_data_dir(data_dir, "bin"))
        return (meta["vocab_size"], meta["_file"]) if meta.get("vocab_size") else (None, "")
    if dataset == "hf" and tokenizer is not None:
        tok = get_tokenizer(tokenizer)
        return tok.vocab_size, f"--tokenizer {tok.name}"
    return None, ""
