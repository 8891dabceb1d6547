"""The tokenize stage: exact round trip, determinism, leak-free validation, mixing shares, dataset."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from llmpipe.document import Document
from llmpipe.tokenization.config import TokenizeConfig
from llmpipe.tokenization.dataset import IGNORE_INDEX, PackedDataset
from llmpipe.tokenization.stage import (
    DROPPED,
    EncodeJob,
    assign_split,
    batch_keys,
    encode_shard,
    gather,
    pieces,
    run_tokenize,
    token_dtype,
)
from llmpipe.tokenization.tokenizer import load_for_encoding

CJK = re.compile(r"[\u4e00-\u9fff]")


def _tokenize(make_ctx, dirs: dict[str, Path], out: Path, workers: int = 1, store_dir: Path | None = None, **cfg):
    ctx = make_ctx("tokenize", TokenizeConfig(**cfg), dirs, out, workers=workers, store_dir=store_dir)
    return ctx, run_tokenize(ctx)


def _stream(out: Path, split: str) -> np.ndarray:
    """All real ids of a split in order (each shard after the first repeats one id: dropped)."""
    index = json.loads((out / "index.json").read_text())
    parts = []
    for k, s in enumerate(index["splits"][split]["shards"]):
        arr = np.fromfile(out / s["file"], dtype=index["dtype"])[: s["tokens"]]
        parts.append(arr if k == 0 else arr[1:])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _docs_of(out: Path, tok_dir: Path, split: str) -> list[str]:
    """Decode a split and cut it at EOS: one string per packed document."""
    bare, meta = load_for_encoding(tok_dir)
    ids = _stream(out, split).tolist()
    texts, cur = [], []
    for t in ids:
        if t == meta["eos_id"]:
            texts.append(bare.decode(cur, skip_special_tokens=False))
            cur = []
        else:
            cur.append(t)
    assert not cur, "every packed document ends with EOS"
    return texts


def test_packed_tokens_decode_to_the_documents_exactly(pipeline_dirs, synth, make_ctx, tmp_path) -> None:
    shards = [synth(50, 20, seed=1), synth(40, 25, seed=2, prefix="x")]
    dirs = pipeline_dirs(shards)
    out = tmp_path / "tok"
    _, stats = _tokenize(make_ctx, dirs, out, workers=2, seq_len=32, val_fraction=0.2, sequences_per_shard=7)
    train, val = _docs_of(out, dirs["tokenizer"], "train"), _docs_of(out, dirs["tokenizer"], "val")
    all_docs = [d for s in shards for d in s]
    cfg = TokenizeConfig(val_fraction=0.2)
    want_val = [d.text for d in all_docs if assign_split(d.id, None, cfg)[0] == 1]
    want_train = [d.text for d in all_docs if assign_split(d.id, None, cfg)[0] == 0]
    assert val == want_val and train == want_train  # exact text, document order kept
    assert 0 < len(val) < len(train)
    assert any("<|endoftext|>" in t for t in train + val)  # literal special strings survive as text
    index = json.loads((out / "index.json").read_text())
    assert index["dtype"] == "uint16" and len(index["splits"]["train"]["shards"]) > 1
    assert stats["docs"] == stats["kept"] == 135 and stats["dropped"] == {}
    meta = json.loads((out / "val_meta.json").read_text())
    assert meta["total_bytes"] == sum(len(t.encode()) for t in want_val)
    assert meta["total_docs"] == len(want_val)
    assert meta["total_tokens"] == index["splits"]["val"]["tokens"]


def test_two_runs_give_identical_shards(pipeline_dirs, synth, make_ctx, tmp_path) -> None:
    def run(name: str) -> dict[str, str]:
        dirs = pipeline_dirs([synth(30, 10, seed=3), synth(20, 10, seed=4, prefix="y")], name=name)
        out = tmp_path / f"tok-{name}"
        ctx = make_ctx("tokenize", TokenizeConfig(seq_len=16, val_fraction=0.1, language_weights={"zh": 2.5}),
                       dirs, out, store_dir=tmp_path / f"store-{name}")
        run_tokenize(ctx)
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}

    a, b = run("a"), run("b")
    assert a == b and any(k.endswith(".bin") for k in a)


def test_no_augmented_doc_and_no_child_of_train_in_val(pipeline_dirs, synth, make_ctx, tmp_path) -> None:
    originals = synth(80, 40, seed=5)
    children = [Document(f"{d.id}-aug", d.text[::-1] + " AUG", d.source,
                         {**d.metadata, "parent_id": d.id, "augment_op": "x"}) for d in originals]
    dirs = pipeline_dirs([originals + children])
    out = tmp_path / "tok"
    _, stats = _tokenize(make_ctx, dirs, out, seq_len=32, val_fraction=0.3)
    cfg = TokenizeConfig(val_fraction=0.3)
    val_parents = {d.id for d in originals if assign_split(d.id, None, cfg)[0] == 1}
    assert 0 < len(val_parents) < len(originals)
    val, train = _docs_of(out, dirs["tokenizer"], "val"), _docs_of(out, dirs["tokenizer"], "train")
    assert not any(t.endswith(" AUG") for t in val)
    aug_in_train = sorted(t for t in train if t.endswith(" AUG"))
    assert aug_in_train == sorted(c.text for c in children if c.metadata["parent_id"] not in val_parents)
    assert stats["dropped"] == {"child_of_val": len(val_parents)}
    assert stats["kept"] + stats["dropped"]["child_of_val"] == stats["docs"]


def _train_tokens_by_lang(out: Path, tok_dir: Path) -> dict[str, int]:
    bare, meta = load_for_encoding(tok_dir)
    counts = {"en": 0, "zh": 0}
    for text in _docs_of(out, tok_dir, "train"):
        n = len(bare.encode(text, add_special_tokens=False).ids) + 1
        counts["zh" if CJK.search(text) else "en"] += n
    return counts


@pytest.mark.parametrize("shares", [{"en": 0.5, "zh": 0.5}, {"en": 0.8, "zh": 0.2}])
def test_language_shares_within_two_percent(pipeline_dirs, synth, make_ctx, tmp_path, shares) -> None:
    dirs = pipeline_dirs([synth(300, 60, seed=6), synth(200, 90, seed=7, prefix="z")])
    out = tmp_path / "tok"
    _, stats = _tokenize(make_ctx, dirs, out, seq_len=64, val_fraction=0.05, language_shares=shares)
    counts = _train_tokens_by_lang(out, dirs["tokenizer"])  # measured from the packed data itself
    total = sum(counts.values())
    for lang, share in shares.items():
        assert abs(counts[lang] / total - share) < 0.02, (counts, shares)
    row = {r["lang"]: r for r in stats["languages"]}
    assert row["zh"]["train_tokens_after"] == counts["zh"] and row["en"]["train_tokens_after"] == counts["en"]


def test_language_and_source_weights(pipeline_dirs, synth, make_ctx, tmp_path) -> None:
    dirs = pipeline_dirs([synth(200, 80, seed=8)])
    base_ctx, base = _tokenize(make_ctx, dirs, tmp_path / "base", seq_len=64, val_fraction=0.0)
    _, mixed = _tokenize(make_ctx, dirs, tmp_path / "mixed", seq_len=64, val_fraction=0.0,
                         language_weights={"zh": 3.0}, source_weights={"books": 0.5})
    before = _train_tokens_by_lang(tmp_path / "base", dirs["tokenizer"])
    after = _train_tokens_by_lang(tmp_path / "mixed", dirs["tokenizer"])
    assert abs(after["zh"] / before["zh"] - 3.0) < 0.02 * 3.0
    assert after["en"] < before["en"]  # books (a third of en) halved
    assert mixed["multipliers"]["en/books"] == 0.5 and mixed["multipliers"]["zh/wiki"] == 3.0
    assert base_ctx.reports[0].key == "tokenize-languages"


def test_long_docs_split_or_truncated_and_short_dropped(pipeline_dirs, make_ctx, tmp_path) -> None:
    long_text = " ".join(["river city house"] * 60)
    docs = [Document("long", long_text, "s", {"lang": "en"}), Document("short", "a", "s", {"lang": "en"}),
            Document("ok", "the old market by the river", "s", {"lang": "en"})]
    dirs = pipeline_dirs([docs])
    _, st = _tokenize(make_ctx, dirs, tmp_path / "split", seq_len=16, val_fraction=0.0, min_tokens=2,
                      max_tokens=20, long_docs="split")
    assert st["dropped"] == {"too_short": 1} and st["split_docs"] == 1 and st["kept"] == 2
    pieces = _docs_of(tmp_path / "split", dirs["tokenizer"], "train")
    assert len(pieces) > 3 and "".join(pieces[:-1]) == long_text and pieces[-1] == docs[2].text
    _, st = _tokenize(make_ctx, dirs, tmp_path / "trunc", seq_len=16, val_fraction=0.0, min_tokens=2,
                      max_tokens=20, long_docs="truncate")
    texts = _docs_of(tmp_path / "trunc", dirs["tokenizer"], "train")
    assert st["truncated"] == 1 and len(texts) == 2 and long_text.startswith(texts[0]) and texts[0] != long_text


def test_val_split_is_stable_when_a_refresh_adds_shards(pipeline_dirs, synth, make_ctx, tmp_path) -> None:
    old = synth(60, 20, seed=9)
    a = pipeline_dirs([old], name="a")
    b = pipeline_dirs([old, synth(60, 20, seed=10, prefix="new")], name="b")
    _tokenize(make_ctx, a, tmp_path / "ta", seq_len=32, val_fraction=0.2)
    _tokenize(make_ctx, b, tmp_path / "tb", seq_len=32, val_fraction=0.2)
    old_texts = {d.text for d in old}
    va = set(_docs_of(tmp_path / "ta", a["tokenizer"], "val"))
    vb = {t for t in _docs_of(tmp_path / "tb", b["tokenizer"], "val") if t in old_texts}
    assert va == vb and va


def test_packed_dataset_random_access_and_padding(pipeline_dirs, synth, make_ctx, tmp_path) -> None:
    dirs = pipeline_dirs([synth(40, 20, seed=11)])
    out = tmp_path / "tok"
    _tokenize(make_ctx, dirs, out, seq_len=16, val_fraction=0.2, sequences_per_shard=5)
    ds = PackedDataset(out, "train")
    stream = _stream(out, "train")
    assert len(ds) == -(-(len(stream) - 1) // 16)
    for i in (0, 4, 5, len(ds) - 1):
        item = ds[i]
        assert item.dtype == torch.long and item.shape == (17,)
        want = stream[i * 16 : i * 16 + 17]
        assert item[: len(want)].tolist() == want.tolist()
    x, y = PackedDataset(out, "train", pairs=True)[len(ds) - 1]
    n_real_targets = len(stream) - 1 - (len(ds) - 1) * 16
    assert x.shape == y.shape == (16,) and (y[:n_real_targets] >= 0).all()
    assert (y[n_real_targets:] == IGNORE_INDEX).all()
    val = PackedDataset(out, "val")
    langs = val.languages(0)
    assert len(langs) == 16 and set(langs.tolist()) <= {0, 1, 255}
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="split must be one of"):
        PackedDataset(out, "test")


def test_dtype_gather_and_config_errors() -> None:
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    arr = np.arange(10)
    assert gather(arr, np.array([2, 7]), np.array([3, 2])).tolist() == [2, 3, 4, 7, 8]
    with pytest.raises(ValidationError, match="shares must sum to 1"):
        TokenizeConfig(language_shares={"en": 0.5, "zh": 0.4})
    with pytest.raises(ValidationError, match="not both"):
        TokenizeConfig(language_shares={"en": 1.0}, language_weights={"en": 2})
    with pytest.raises(ValidationError, match=r"must be in \[0, 1\)"):
        TokenizeConfig(val_fraction=1.0)


def test_share_for_missing_language_is_a_clear_error(pipeline_dirs, synth, make_ctx, tmp_path) -> None:
    dirs = pipeline_dirs([synth(20, 5, seed=12)])
    with pytest.raises(ValueError, match=r"language_shares: languages \['fr'\]"):
        _tokenize(make_ctx, dirs, tmp_path / "t", language_shares={"en": 0.5, "fr": 0.5})


def test_tiny_corpus_still_gets_min_val_docs_without_leaks(pipeline_dirs, synth, make_ctx, tmp_path) -> None:
    originals = synth(6, 2, seed=13)
    children = [Document(f"{d.id}-aug", d.text + " AUG", d.source, {**d.metadata, "parent_id": d.id})
                for d in originals]
    dirs = pipeline_dirs([originals + children])
    _, st = _tokenize(make_ctx, dirs, tmp_path / "t", seq_len=16, val_fraction=1e-9, min_val_docs=2)
    val = _docs_of(tmp_path / "t", dirs["tokenizer"], "val")
    train = _docs_of(tmp_path / "t", dirs["tokenizer"], "train")
    assert len(val) == 2 and not any(t.endswith(" AUG") for t in val)
    assert not any(t == v + " AUG" for t in train for v in val)  # the moved docs' children are gone
    assert st["dropped"] == {"child_of_val": 2} and st["kept"] + 2 == st["docs"] == 16
    assert len(train) == 12


def test_batch_keys_match_assign_split() -> None:
    ids = [f"doc{i}" for i in range(400)]
    parents: list[str | None] = [None if i % 3 else f"doc{i // 2}" for i in range(400)]
    parents[5], parents[7] = "", None  # an empty parent id is no parent
    for cfg in (TokenizeConfig(), TokenizeConfig(val_fraction=0.3, split_salt="s"), TokenizeConfig(val_fraction=0.0),
                TokenizeConfig(val_fraction=0.999)):
        split, group, order, child = batch_keys(ids, parents, cfg)
        for i, (doc, parent) in enumerate(zip(ids, parents, strict=True)):
            s, g, o = assign_split(doc, parent, cfg)
            assert (split[i], group[i], order[i], child[i]) == (DROPPED if s is None else s, g, o, int(bool(parent)))
    assert [a.size for a in batch_keys([], [], TokenizeConfig())] == [0, 0, 0, 0]


def test_encoded_shard_does_not_depend_on_batching(pipeline_dirs, synth, make_ctx, tmp_path) -> None:
    """Batch size and characters per batch only pace the encoder: same bytes, same stats."""
    docs = synth(60, 30, seed=14)
    docs += [Document(f"{d.id}-aug", d.text + " AUG", d.source, {**d.metadata, "parent_id": d.id}) for d in docs[:40]]
    docs.append(Document("long", " ".join(["river city house <|endoftext|>"] * 40), "s", {"lang": "en"}))
    dirs = pipeline_dirs([docs])
    path, tok = str(next((dirs["augment"] / "shards").glob("*.parquet"))), str(dirs["tokenizer"])
    for extra in ({}, {"max_tokens": 12, "long_docs": "truncate", "add_bos": True}, {"max_tokens": 9, "min_tokens": 3}):
        outs = []
        for k, batching in enumerate(({}, {"batch_size": 7, "batch_chars": 300})):
            out = tmp_path / f"enc-{len(extra)}-{k}"
            out.mkdir()
            st = encode_shard(EncodeJob(path, tok, TokenizeConfig(val_fraction=0.3, **extra, **batching)), out)
            outs.append((st, [(f.name, f.read_bytes()) for f in sorted(out.iterdir())]))
        assert outs[0] == outs[1]
        assert outs[0][0]["dropped"].get("child_of_val") and outs[0][0]["docs"] == len(docs)


def test_pieces_cover_every_row_once() -> None:
    assert pieces(5, 2048) == [(0, None)] and pieces(0, 10) == [(0, None)]
    for rows, per in ((5000, 2048), (4097, 4096), (10, 3), (12, 4), (2049, 2048)):
        got = pieces(rows, per)
        assert got[0][0] == 0 and got[-1][1] == rows and len(got) == -(-rows // per)
        assert all(a[1] == b[0] for a, b in zip(got, got[1:], strict=False))
        assert all(0 < stop - start <= per for start, stop in got)


def test_output_does_not_depend_on_encode_pieces(pipeline_dirs, synth, make_ctx, tmp_path) -> None:
    """Shards split into encode tasks of a few documents give the same bytes and stats as whole shards."""
    originals = synth(70, 30, seed=21)
    children = [Document(f"{d.id}-aug", d.text + " AUG", d.source, {**d.metadata, "parent_id": d.id})
                for d in originals[::3]]
    shards = [originals[:60] + children[:10], originals[60:] + children[10:]]
    dirs = pipeline_dirs(shards)
    cfg = {"seq_len": 16, "val_fraction": 0.2, "language_weights": {"zh": 1.7}, "max_tokens": 20, "add_bos": True}
    runs = []
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    # the last run encodes its pieces afresh on two threads of this process (a store of its own)
    for k, (piece_docs, workers, store) in enumerate(((2048, 1, None), (7, 1, None), (7, 2, None),
                                                      (7, 2, tmp_path / "store-threads"))):
        out = tmp_path / f"tok-{k}"
        ctx, stats = _tokenize(make_ctx, dirs, out, workers=workers, store_dir=store, piece_docs=piece_docs, **cfg)
        files = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
        runs.append((files, {key: v for key, v in stats.items() if key != "languages"}, stats["languages"]))
        assert os.environ.get("TOKENIZERS_PARALLELISM") == parallelism  # restored after the threaded encode
    assert runs[0] == runs[1] == runs[2] == runs[3]
    n_pieces = sum(len(pieces(len(docs), 7)) for docs in shards)
    done = list((tmp_path / "store" / "tokenize").rglob("_DONE.json"))
    assert len(done) == 2 + n_pieces  # pieces reused by the third run
    assert len(list((tmp_path / "store-threads" / "tokenize").rglob("_DONE.json"))) == n_pieces


def test_gather_copies_runs_and_scattered_segments_alike() -> None:
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 60000, 50_000).astype(np.uint16)
    for trial in range(60):
        n = int(rng.integers(0, 300))
        if trial % 2:  # mostly contiguous, as a split's segments are
            lengths = rng.integers(0, 200, n)
            starts = np.cumsum(lengths) - lengths
            keep = rng.random(n) < 0.95
            starts, lengths = starts[keep], lengths[keep]
        else:
            lengths, starts = rng.integers(0, 40, n), rng.integers(0, 49_000, n)
        fits = starts + lengths <= arr.size
        starts, lengths = starts[fits], lengths[fits]
        want = [arr[s : s + m] for s, m in zip(starts.tolist(), lengths.tolist(), strict=True)]
        got = gather(arr, starts, lengths)
        assert got.dtype == arr.dtype and got.tolist() == (np.concatenate(want).tolist() if want else [])


def test_encode_threads_end_with_the_worker_threads_that_used_them() -> None:
    """Each worker thread has its own encode thread; it must not outlive the stage's thread pool."""
    import gc
    import threading
    import time

    from llmpipe.executor import LocalExecutor
    from llmpipe.tokenization import stage as pack

    def job(x: int) -> int:
        return pack._encode_pool().submit(abs, -x).result()

    for _ in range(4):
        assert LocalExecutor(2).map(job, list(range(6)), threads=True) == list(range(6))
    gc.collect()
    allowed = 1 if getattr(pack._LOCAL, "pool", None) else 0  # this thread's own, if an earlier test encoded here

    def left() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("llmpipe-encode")]

    deadline = time.time() + 5
    while time.time() < deadline and len(left()) > allowed:
        time.sleep(0.05)
    assert len(left()) <= allowed, left()
