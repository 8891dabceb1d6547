"""The entity mask of the tokenize stage: packed beside the ids in the same layout, aligned exactly, so
the masked tokens decode back to the documents' span texts; off, nothing of it is written."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from llmpipe.curation.entities.config import RuleSettings
from llmpipe.curation.entities.rules import RuleRecognizer
from llmpipe.document import Document
from llmpipe.tokenization.config import TokenizeConfig
from llmpipe.tokenization.dataset import PackedDataset
from llmpipe.tokenization.stage import entity_mask, run_tokenize
from llmpipe.tokenization.tokenizer import load_for_encoding

EN_ENTITIES = ["on March 5, 2024", "for $300", "in Berlin", "at 14:30", "by Angela Merkel", "to 12%",
               "see https://example.com/x", "of 3.5 km"]
ZH_ENTITIES = ["北京大学", "李明", "2024年3月5日", "500万元"]


def _docs(tmp: Path, n: int) -> list[Document]:
    (tmp / "g.tsv").write_text("Berlin\tLOC\nAngela Merkel\tPER\n北京大学\tORG\n李明\tPER\n", encoding="utf-8")
    rec = RuleRecognizer(RuleSettings(gazetteers=[str(tmp / "g.tsv")]))
    rng = random.Random(5)
    words = "the river city house child runs over under bright market bread water stone light".split()
    docs = []
    for i in range(n):
        if i % 4 == 0:
            text = "我们".join(rng.choice(ZH_ENTITIES) + "的学生很多" for _ in range(rng.randint(1, 3))) + "。"
            lang = "zh"
        else:
            parts = [" ".join(rng.choices(words, k=rng.randint(1, 6))) + " " + rng.choice(EN_ENTITIES)
                     for _ in range(rng.randint(1, 8))]
            text = "The " + " the ".join(parts) + " is here."
            lang = "en"
        meta = {"lang": lang, "entities": rec.recognize([text])[0]}
        docs.append(Document(f"e{i}", text, "web", meta))
    return docs


def _streams(out: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    index = json.loads((out / "index.json").read_text())
    ids, masks = [], []
    for k, s in enumerate(index["splits"][split]["shards"]):
        a = np.fromfile(out / s["file"], dtype=index["dtype"])[: s["tokens"]]
        m = np.load(out / s["entity_file"])[: s["tokens"]]
        assert m.shape == a.shape and m.dtype == np.uint8
        ids.append(a if k == 0 else a[1:])
        masks.append(m if k == 0 else m[1:])
    return np.concatenate(ids), np.concatenate(masks)


def _masked_runs(ids: np.ndarray, mask: np.ndarray, eos: int, bare) -> list[list[str]]:  # noqa: ANN001
    """Per packed document, the decoded text of each run of consecutive masked tokens."""
    docs, runs, cur = [], [], []
    for t, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            cur.append(t)
            continue
        if cur:
            runs.append(bare.decode(cur))
            cur = []
        if t == eos:
            docs.append(runs)
            runs = []
    return docs


def test_masked_tokens_decode_to_the_span_texts(pipeline_dirs, make_ctx, tmp_path) -> None:  # noqa: ANN001
    docs = _docs(tmp_path, 120)
    assert sum(len(d.metadata["entities"]) for d in docs) > 300
    dirs = pipeline_dirs([docs[:70], docs[70:]])
    out = tmp_path / "tok"
    cfg = TokenizeConfig(seq_len=32, val_fraction=0.2, sequences_per_shard=7, entity_mask=True)
    run_tokenize(make_ctx("tokenize", cfg, dirs, out))
    index = json.loads((out / "index.json").read_text())
    assert index["entity_mask"] is True and len(index["splits"]["train"]["shards"]) > 1
    bare, meta = load_for_encoding(dirs["tokenizer"])
    by_text = {d.text: d for d in docs}
    checked = 0
    for split in ("train", "val"):
        ids, mask = _streams(out, split)
        assert not mask[ids == meta["eos_id"]].any()  # EOS is never an entity token
        texts = []  # the packed documents, to pair each with its source document
        cur: list[int] = []
        for t in ids.tolist():
            if t == meta["eos_id"]:
                texts.append(bare.decode(cur))
                cur = []
            else:
                cur.append(t)
        for text, runs in zip(texts, _masked_runs(ids, mask, meta["eos_id"], bare), strict=True):
            spans = [s["text"] for s in by_text[text].metadata["entities"]]
            if by_text[text].metadata["lang"] == "en":  # spaced: each run is exactly one span
                assert [r.strip() for r in runs] == spans, text
            else:  # no spaces: a token may reach past a span's edge, never miss one
                joined = "".join(runs)
                assert all(s in joined for s in spans) and len(runs) <= len(spans), text
            checked += len(spans)
    assert checked == sum(len(d.metadata["entities"]) for d in docs)
    ds = PackedDataset(out, "train")
    assert ds.entity_mask(0).shape == (32,) and sum(int(ds.entity_mask(i).sum()) for i in range(len(ds))) > 0


def test_mask_off_writes_nothing_of_it(pipeline_dirs, make_ctx, tmp_path) -> None:  # noqa: ANN001
    docs = _docs(tmp_path, 20)
    dirs = pipeline_dirs([docs])
    out = tmp_path / "tok"
    run_tokenize(make_ctx("tokenize", TokenizeConfig(seq_len=32, val_fraction=0.2), dirs, out))
    index = json.loads((out / "index.json").read_text())
    assert "entity_mask" not in index and not list(out.glob("*.entity.npy"))
    assert all("entity_file" not in s for sp in index["splits"].values() for s in sp["shards"])


def test_token_overlap_rule() -> None:
    spans = [{"start": 4, "end": 9}, {"start": 12, "end": 13}]
    offsets = [(0, 3), (3, 4), (3, 5), (8, 9), (9, 12), (12, 13), (13, 20), (5, 5)]
    assert entity_mask(offsets, spans).tolist() == [0, 0, 1, 1, 0, 1, 0, 0]


def test_mask_follows_split_and_truncated_documents(pipeline_dirs, make_ctx, tmp_path) -> None:  # noqa: ANN001
    docs = [d for d in _docs(tmp_path, 80) if d.metadata["lang"] == "en"]
    span_texts = {s["text"] for d in docs for s in d.metadata["entities"]}
    dirs = pipeline_dirs([docs])
    bare, meta = load_for_encoding(dirs["tokenizer"])
    for mode in ("split", "truncate"):
        out = tmp_path / f"tok-{mode}"
        cfg = TokenizeConfig(seq_len=32, val_fraction=0.0, max_tokens=12, long_docs=mode, entity_mask=True)
        run_tokenize(make_ctx("tokenize", cfg, dirs, out))
        ids, mask = _streams(out, "train")
        runs = [r.strip() for piece in _masked_runs(ids, mask, meta["eos_id"], bare) for r in piece]
        assert runs and all(any(r in t for t in span_texts) for r in runs if r), mode  # pieces of spans only
