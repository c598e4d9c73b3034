"""Token data on disk for the Llama trainer: ``python -m mmm.data prepare`` (uint16 and uint32 token
files), ``--dataset bin`` and ``--dataset hf`` (a text column tokenised at load, pre-tokenised
input_ids). Everything is built here from text that ships with Python (``mmm.data.pydoc_text``):
a small BPE tokenizer is trained in the test, nothing is downloaded.

Checks: the windows of a step are the same whatever the dp split; the trainer on 2 ranks (tp 2)
gives one process's per-step loss and gradient norm; a resumed run continues on the same batches;
bad input is one line naming the file and the value.
"""

from __future__ import annotations

import json
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import assert_clean_user_error, jsonl, launch, max_rel_diff, on_ranks, run

tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install 'mmm[data]')")

MODULE = ["-m", "mmm.examples.fsdp_tp"]
TINY = ["--dim", "64", "--n-layers", "2", "--seq-len", "32", "--batch-size", "4", "--seed", "3", "--no-plots"]
RTOL = 1e-5
VOCAB = 400
N_DOCS = 5


def train_tokenizer(docs: list[str], path) -> None:
    """A byte-level BPE of VOCAB tokens (with <|endoftext|>) trained on ``docs``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(str(path))


def prepare(*args: str):
    res = run([sys.executable, "-m", "mmm.data", "prepare", *args], timeout=120)
    assert res.returncode == 0, res.output
    return res


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The pydoc text as N_DOCS documents (files), a BPE tokenizer trained on it, and token files of
    both dtypes written by the prepare command."""
    from mmm.data import pydoc_text

    root = tmp_path_factory.mktemp("corpus")
    text = pydoc_text().decode("utf-8")
    size = -(-len(text) // N_DOCS)
    docs = [text[i : i + size] for i in range(0, len(text), size)]
    (root / "docs").mkdir()
    for i, doc in enumerate(docs):
        (root / "docs" / f"doc{i}.txt").write_text(doc, encoding="utf-8")
    tokenizer = root / "tokenizer.json"
    train_tokenizer(docs, tokenizer)
    prepare("--tokenizer", str(tokenizer), "--out", str(root / "bin16"), str(root / "docs"))
    prepare(
        "--tokenizer",
        str(tokenizer),
        "--dtype",
        "uint32",
        "--val-fraction",
        "0.1",
        "--out",
        str(root / "bin32"),
        *(str(root / "docs" / f"doc{i}.txt") for i in range(N_DOCS)),
    )
    tok = tokenizers.Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    stream = np.concatenate([np.asarray(tok.encode(d, add_special_tokens=False).ids + [eos]) for d in docs])
    return SimpleNamespace(
        root=root, docs=docs, tokenizer=tokenizer, eos=eos, stream=stream, bin16=root / "bin16", bin32=root / "bin32"
    )


def test_prepare_writes_both_dtypes_and_meta(corpus):
    n = len(corpus.stream)
    n_val = -(-n // 10)
    for d, dtype in ((corpus.bin16, np.uint16), (corpus.bin32, np.uint32)):
        meta = json.loads((d / "meta.json").read_text())
        assert meta["dtype"] == np.dtype(dtype).name and meta["vocab_size"] == VOCAB
        assert meta["eos_id"] == corpus.eos and meta["eos_token"] == "<|endoftext|>"
        assert meta["tokens"] == {"train": n - n_val, "val": n_val}
        train, val = np.fromfile(d / "train.bin", dtype=dtype), np.fromfile(d / "val.bin", dtype=dtype)
        assert np.array_equal(np.concatenate([train, val]), corpus.stream)  # each file a document + <|endoftext|>
        assert meta["max_token"] == {"train": int(train.max()), "val": int(val.max())}
        assert (d / "tokenizer.json").read_bytes() == corpus.tokenizer.read_bytes()
    assert (corpus.bin32 / "train.bin").stat().st_size == 2 * (corpus.bin16 / "train.bin").stat().st_size


def test_a_prepare_over_an_earlier_one_leaves_no_tokenizer_of_the_old_tokens(corpus, tmp_path):
    """Prepared again with bytes where a BPE dataset was: the old tokenizer.json goes (an export would ship it
    with the byte-level tokens), and a tokenizer.json put back by hand is not taken for the tokens'."""
    from mmm.data import data_tokenizer

    out = tmp_path / "data"
    prepare("--tokenizer", str(corpus.tokenizer), "--out", str(out), str(corpus.root / "docs" / "doc0.txt"))
    assert data_tokenizer("bin", out) == out / "tokenizer.json"
    prepare("--tokenizer", "bytes", "--out", str(out), str(corpus.root / "docs" / "doc0.txt"))
    assert json.loads((out / "meta.json").read_text())["tokenizer"] == "bytes"
    assert not (out / "tokenizer.json").exists()
    (out / "tokenizer.json").write_bytes(corpus.tokenizer.read_bytes())
    assert data_tokenizer("bin", out) is None
    (out / "meta.json").unlink()  # a folder of token files without meta.json: its tokenizer.json is the one
    assert data_tokenizer("bin", out) == out / "tokenizer.json"


def test_windows_are_the_same_for_any_dp_split_and_dtype(corpus):
    from mmm.data import local_batches, make_dataset
    from mmm.data.seeds import step_generator

    seq, batch = 32, 8
    d16 = make_dataset("bin", vocab_size=VOCAB, seq_len=seq, data_dir=corpus.bin16)
    d32 = make_dataset("bin", vocab_size=VOCAB, seq_len=seq, data_dir=corpus.bin32)
    train = np.fromfile(corpus.bin16 / "train.bin", dtype=np.uint16).astype(np.int64)
    for step in (0, 1, 7):
        whole = d16.global_batch(5, step, batch)
        assert whole.shape == (batch, seq + 1) and whole.dtype == torch.int64
        for dp in (2, 4):
            local = batch // dp
            parts = [d16.global_batch(5, step, batch, rows=slice(r * local, (r + 1) * local)) for r in range(dp)]
            assert torch.equal(torch.cat(parts), whole)
        assert torch.equal(d32.global_batch(5, step, batch), whole)  # uint32 files read as the same tokens
        starts = torch.randint(0, len(train) - seq, (batch,), generator=step_generator(5, step))
        assert torch.equal(whole, torch.stack([torch.from_numpy(train[s : s + seq + 1]) for s in starts.tolist()]))
    # the trainer's iterator: dp rank r's rows of each step, inputs and labels shifted by one
    x, y = next(local_batches(d16, seed=5, global_batch=batch, dp_rank=1, dp_size=2, start_step=7))
    mine = d16.global_batch(5, 7, batch)[4:]
    assert torch.equal(x, mine[:, :-1]) and torch.equal(y, mine[:, 1:])
    assert d16.global_batch(5, 0, batch).ne(d16.global_batch(6, 0, batch)).any()  # the seed matters
    val = make_dataset("bin", vocab_size=VOCAB, seq_len=seq, data_dir=corpus.bin16, split="val")
    val_tokens = np.fromfile(corpus.bin16 / "val.bin", dtype=np.uint16)
    assert len(val) == len(val_tokens) and val.global_batch(0, 0, 2).max() < VOCAB


def test_every_seed_the_flags_accept_draws_batches():
    """The largest seed `--seed` accepts (2**63 - 1) gives batches in every data source (a seed times the
    step stride once overflowed the generator's range: a traceback for a valid flag)."""
    from mmm.cli import random_seed
    from mmm.data import SyntheticTokens, step_seed
    from mmm.data.images import SyntheticImages, epoch_batches
    from mmm.verify import token_batches

    top = random_seed(str(2**63 - 1))
    assert step_seed(top, 3) != step_seed(top, 4) and step_seed(5, 7) == 5 * 1_000_003 + 7  # small seeds as before
    assert SyntheticTokens(16, 8).global_batch(top, 3, 2).shape == (2, 9)
    assert SyntheticImages(4, 3).global_batch(top, 3, 2, split="val")[0].shape == (2, 3, 4, 4)
    assert len(epoch_batches(10, global_batch=4, seed=top, epoch=2)) == 2
    assert token_batches(16, 8, 2, seed=top)(3)[0].shape == (2, 8)


@pytest.fixture(scope="module")
def hf_dirs(corpus):
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install 'mmm[data]')")
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    tok = tokenizers.Tokenizer.from_file(str(corpus.tokenizer))
    ids = [tok.encode(d, add_special_tokens=False).ids + [corpus.eos] for d in corpus.docs]
    text, pre = corpus.root / "hf_text", corpus.root / "hf_ids"
    datasets.Dataset.from_dict({"text": corpus.docs, "n": list(range(N_DOCS))}).save_to_disk(str(text))
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"input_ids": ids}),
            "validation": datasets.Dataset.from_dict({"input_ids": ids[:1]}),
        }
    ).save_to_disk(str(pre))
    return SimpleNamespace(text=text, pre=pre)


def test_hf_datasets_give_the_token_stream(corpus, hf_dirs):
    from mmm.data import make_dataset
    from mmm.data.tokens import hf_token_array
    from mmm.errors import UsageError

    tokens, _ = hf_token_array(hf_dirs.text, tokenizer=str(corpus.tokenizer))  # text column, tokenised at load
    assert np.array_equal(tokens, corpus.stream)
    tokens, _ = hf_token_array(hf_dirs.pre)  # input_ids, as they are
    assert np.array_equal(tokens, corpus.stream)
    val, source = hf_token_array(hf_dirs.pre, split="val")
    assert "validation" in source and len(val) == len(tokens[: np.flatnonzero(corpus.stream == corpus.eos)[0] + 1])
    raw, _ = hf_token_array(hf_dirs.text, tokenizer="bytes")  # byte-level: UTF-8 bytes, byte 0 ends a document
    assert np.array_equal(raw, np.frombuffer(b"".join(d.encode() + b"\0" for d in corpus.docs), dtype=np.uint8))
    a = make_dataset("hf", vocab_size=VOCAB, seq_len=32, data_dir=hf_dirs.text, tokenizer=str(corpus.tokenizer))
    b = make_dataset("hf", vocab_size=VOCAB, seq_len=32, data_dir=hf_dirs.pre)
    assert torch.equal(a.global_batch(1, 3, 8), b.global_batch(1, 3, 8))
    with pytest.raises(UsageError, match=r"holds one dataset, no 'val' split"):
        make_dataset("hf", vocab_size=VOCAB, seq_len=32, data_dir=hf_dirs.text, split="val", tokenizer="bytes")
    with pytest.raises(UsageError, match=r"is not a dataset saved with save_to_disk"):
        make_dataset("hf", vocab_size=VOCAB, seq_len=32, data_dir=corpus.bin16)
    with pytest.raises(UsageError, match=r"has no column 'body' \(it has: text, n\)"):
        make_dataset("hf", vocab_size=VOCAB, seq_len=32, data_dir=hf_dirs.text, text_column="body")


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """One process, 12 steps on the uint16 token files (vocabulary from meta.json)."""
    out = tmp_path_factory.mktemp("bin1")
    res = run(
        [
            sys.executable,
            *MODULE,
            *TINY,
            "--dataset",
            "bin",
            "--data-dir",
            str(corpus.bin16),
            "--max-iters",
            "12",
            "--outdir",
            str(out),
        ],
        timeout=180,
    )
    assert res.returncode == 0, res.output
    assert "vocab_size=400" in res.output  # the model's vocabulary came from the data
    return jsonl(out / "history.jsonl", key=None)


def test_loss_falls_on_the_token_files(reference):
    losses = [r["loss"] for r in reference]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses


def test_two_ranks_match_one_process_and_resume_on_the_same_batches(corpus, reference, tmp_path):
    """tp 2 on the uint32 files for 3 steps (checkpointed) = one process on uint16; resumed at dp 2 to
    step 6, the steps go on as the uninterrupted run's."""
    out, ck = tmp_path / "run", tmp_path / "ck"
    common = [*MODULE, *TINY, "--dataset", "bin", "--data-dir", str(corpus.bin32), "--checkpoint-dir", str(ck)]
    res = run(
        launch("-n", "2", "python3", *common, "--tpsize", "2", "--max-iters", "3", "--outdir", str(out)), timeout=240
    )
    assert res.returncode == 0, res.output
    got = jsonl(out / "history.jsonl", key=None)
    for key in ("loss", "grad_norm"):
        assert max_rel_diff([r[key] for r in got], [r[key] for r in reference[:3]]) <= RTOL, key
    res = run(on_ranks(2, *common, "--max-iters", "6", "--resume", "latest", "--outdir", str(out)), timeout=240)
    assert res.returncode == 0, res.output
    assert "resumed from" in res.output
    got = jsonl(out / "history.jsonl", key=None)
    assert [r["iter"] for r in got] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm"):
        assert max_rel_diff([r[key] for r in got], [r[key] for r in reference[:6]]) <= RTOL, key


def test_trainer_on_a_saved_hf_dataset(corpus, hf_dirs, tmp_path):
    """Text tokenised at load (vocabulary from the tokenizer) on one process = pre-tokenised input_ids
    on tp 2 (vocabulary from --vocab-size): the same stream, the same steps."""
    one, two = tmp_path / "text", tmp_path / "ids"
    res = run(
        [
            sys.executable,
            *MODULE,
            *TINY,
            "--dataset",
            "hf",
            "--data-dir",
            str(hf_dirs.text),
            "--tokenizer",
            str(corpus.tokenizer),
            "--max-iters",
            "3",
            "--outdir",
            str(one),
        ],
        timeout=180,
    )
    assert res.returncode == 0, res.output
    assert "vocab_size=400" in res.output
    res = run(
        launch(
            "-n",
            "2",
            "python3",
            *MODULE,
            *TINY,
            "--dataset",
            "hf",
            "--data-dir",
            str(hf_dirs.pre),
            "--vocab-size",
            str(VOCAB),
            "--tp",
            "2",
            "--max-iters",
            "3",
            "--outdir",
            str(two),
        ),
        timeout=240,
    )
    assert res.returncode == 0, res.output
    a, b = (jsonl(d / "history.jsonl", key=None) for d in (one, two))
    for key in ("loss", "grad_norm"):
        assert max_rel_diff([r[key] for r in b], [r[key] for r in a]) <= RTOL, key
    assert json.loads((two / "summary.json").read_text())["dataset"] == f"hf:{hf_dirs.pre.name}"


def test_a_text_dataset_is_tokenised_once_per_job(corpus, hf_dirs, tmp_path):
    """2 ranks on the text column: rank 0 tokenises it into one token file beside the dataset, every rank
    memory-maps it (not a copy of the corpus per rank); the next job with the same data and tokenizer
    reuses the file, and one after it was cut short writes it again; the stream and the steps are one
    process's."""
    from mmm.data.tokens import TOKEN_CACHE, hf_token_array

    cache = hf_dirs.text / TOKEN_CACHE
    shutil.rmtree(cache, ignore_errors=True)
    flags = [*MODULE, *TINY, "--dataset", "hf", "--data-dir", str(hf_dirs.text), "--tokenizer", str(corpus.tokenizer)]
    one = tmp_path / "one"
    res = run([sys.executable, *flags, "--max-iters", "3", "--outdir", str(one)], timeout=180)
    assert res.returncode == 0 and not cache.exists(), res.output  # one process: nothing to share
    outs = []
    for attempt in range(3):
        outs.append(tmp_path / f"two{attempt}")
        res = run(launch("-n", "2", "python3", *flags, "--max-iters", "3", "--outdir", str(outs[-1])), timeout=240)
        assert res.returncode == 0, res.output
        (token_file,) = cache.glob("train-*.bin")
        if attempt == 0:
            written = token_file.stat().st_mtime_ns
        if attempt == 1:
            assert token_file.stat().st_mtime_ns == written  # reused, not written again
            with open(token_file, "r+b") as f:  # then cut short (a full disk, a copy broken off)
                f.truncate(token_file.stat().st_size - 6)
    assert "not visible" not in res.output, res.output  # written again, whole (its tokens checked below)
    want, _ = hf_token_array(hf_dirs.text, tokenizer=str(corpus.tokenizer))
    meta = json.loads(token_file.with_suffix(".json").read_text())
    assert np.array_equal(np.fromfile(token_file, dtype=meta["dtype"]), want)
    for out in outs:
        for key in ("loss", "grad_norm"):
            got, ref = jsonl(out / "history.jsonl", key), jsonl(one / "history.jsonl", key)
            assert max_rel_diff(got, ref) <= RTOL, key


def _write_tokens(path, values, dtype=np.uint16):
    path.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(values, dtype=dtype).tofile(path)


def test_bad_data_is_one_line_naming_the_file_and_value(corpus, tmp_path):
    big = tmp_path / "big" / "train.bin"  # ids up to 300, no meta.json: the default vocabulary is 256
    _write_tokens(big, np.arange(1000) % 301)
    res = run(
        launch(
            "--launcher",
            "local",
            "-n",
            "2",
            "python3",
            *MODULE,
            *TINY,
            "--dataset",
            "bin",
            "--data-dir",
            str(big.parent),
            "--max-iters",
            "1",
        ),
        timeout=120,
    )
    assert_clean_user_error(res, f"{big}: token id 300 >= --vocab-size 256", "pass --vocab-size 301 or more")
    assert res.returncode == 2
    assert len([line for line in res.stderr.splitlines() if "error:" in line and "launch:" not in line]) == 1
    short = tmp_path / "short" / "train.uint32.bin"  # the dtype in the name
    _write_tokens(short, range(20), np.uint32)
    for flags, needles in [
        (["--data-dir", str(short.parent)], [f"{short} holds 20 tokens, fewer than one window of --seq-len 32 + 1"]),
        (["--data-dir", str(tmp_path / "nope")], [f"--data-dir '{tmp_path / 'nope'}' does not exist"]),
        (
            ["--data-dir", str(corpus.bin16), "--vocab-size", "300"],
            ["--vocab-size 300 is smaller than the data's vocabulary 400", "meta.json"],
        ),
    ]:
        res = run([sys.executable, *MODULE, *TINY, "--dataset", "bin", *flags, "--max-iters", "1"], timeout=120)
        assert_clean_user_error(res, *needles)
        assert res.returncode == 2 and len([line for line in res.stderr.splitlines() if "error:" in line]) == 1


def test_bad_flags_found_before_any_data_is_read(corpus, tmp_path):
    """Problems the flag check lists (every rank, at once), and those the loaders raise, by message."""
    from mmm.data import dataset_problems, make_dataset
    from mmm.errors import UsageError

    assert dataset_problems("bin", vocab_size=VOCAB) == ["--dataset bin reads a directory: add --data-dir DIR"]
    assert dataset_problems("synthetic", vocab_size=256, data_dir="x")[0].startswith(
        "--data-dir only applies with --dataset bin or hf (got --dataset synthetic); pick one of those or drop it"
    )
    assert dataset_problems("pydoc", vocab_size=256, text_column="text") == [
        "--text-column only applies with --dataset hf (got --dataset pydoc); pick it or drop it"
    ]
    assert (
        "--tokenizer 'nope.json' does not exist"
        in dataset_problems("hf", vocab_size=256, data_dir=corpus.root, tokenizer="nope.json")[0]
    )
    odd = tmp_path / "odd" / "train.bin"
    odd.parent.mkdir()
    odd.write_bytes(b"\0" * 99)
    (odd.parent / "meta.json").write_text(json.dumps({"dtype": "uint32"}))
    with pytest.raises(UsageError, match=r"train.bin is 99 bytes, not a whole number of uint32 tokens"):
        make_dataset("bin", vocab_size=256, seq_len=8, data_dir=odd.parent)
    (odd.parent / "train.uint16.bin").write_bytes(b"\0" * 100)
    with pytest.raises(UsageError, match=r"2 token files for 'train': train.bin, train.uint16.bin; keep one"):
        make_dataset("bin", vocab_size=256, seq_len=8, data_dir=odd.parent)
    res = run(
        [sys.executable, "-m", "mmm.data", "prepare", "--out", str(tmp_path / "o"), str(tmp_path / "none.txt")],
        timeout=60,
    )
    assert_clean_user_error(res, f"{tmp_path / 'none.txt'} does not exist")
    assert res.returncode == 2


def test_nanogpt_meta_pkl_gives_the_vocabulary_and_nothing_else_runs(tmp_path):
    """nanoGPT's shakespeare_char layout: train.bin (uint16) + meta.pkl with vocab_size; a pickle that
    names a class is refused, not run."""
    import pickle

    from mmm.data import data_vocab_size, make_dataset
    from mmm.errors import UsageError

    chars = sorted(set("to be or not to be"))
    _write_tokens(tmp_path / "train.bin", [chars.index(c) for c in "to be or not to be" * 4])
    (tmp_path / "meta.pkl").write_bytes(
        pickle.dumps(
            {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
        )
    )
    assert data_vocab_size("bin", data_dir=tmp_path) == (len(chars), str(tmp_path / "meta.pkl"))
    data = make_dataset("bin", vocab_size=len(chars), seq_len=8, data_dir=tmp_path)
    assert data.global_batch(0, 0, 2).max() < len(chars)
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 7, "x": SimpleNamespace()}))
    with pytest.raises(UsageError, match=r"meta.pkl could not be read \(refusing to load types.SimpleNamespace"):
        data_vocab_size("bin", data_dir=tmp_path)


def test_a_plain_bin_file_is_never_silently_read_as_the_wrong_dtype(tmp_path):
    """train.bin with no meta.json is read as nanoGPT's uint16: uint32 tokens read that way trained as
    garbage without a word (the size check passes, and the id check whenever vocab > 65535)."""
    from mmm.data import make_dataset
    from mmm.errors import UsageError

    d = tmp_path / "llama3"
    _write_tokens(d / "train.bin", np.arange(4000) % 300, np.uint32)  # small ids stored as uint32
    with pytest.raises(UsageError, match=r"every second value is 0: it looks like uint32 tokens"):
        make_dataset("bin", vocab_size=512, seq_len=8, data_dir=d)
    with pytest.raises(UsageError, match=r"--vocab-size 128256 has ids above 65535 that uint16 cannot hold"):
        make_dataset("bin", vocab_size=128256, seq_len=8, data_dir=d)
    (d / "meta.json").write_text(json.dumps({"dtype": "uint32"}))  # the fix the message names
    data = make_dataset("bin", vocab_size=128256, seq_len=8, data_dir=d)
    assert data.max_token == 299
    u16 = tmp_path / "gpt2"  # real uint16 data with no meta.json still reads as before
    _write_tokens(u16 / "train.bin", np.arange(4000) % 300)
    assert make_dataset("bin", vocab_size=512, seq_len=8, data_dir=u16).max_token == 299
