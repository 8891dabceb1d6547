"""Tokenize-and-pack throughput: our ``tokenize`` stage vs a bare ``tokenizers`` ``encode_batch``.

Both sides encode the same documents with the same byte-level BPE (trained first, not timed). The
baseline is the plain way to get token ids from ``tokenizers`` in Python, on texts already in memory:
``ids = [e.ids for e in tok.encode_batch(texts)]``, timed until that expression is done (reading
``.ids`` and releasing the ``Encoding`` objects take about a sixth of it, single-threaded; the call
alone is printed too, for reference). Ours is the
whole ``tokenize`` stage on the same texts stored as Parquet shards: read the shards, assign splits,
encode, append EOS, mix, pack into fixed-length uint16 sequence shards with their index, on a fresh
store (no cache). The metric is the ratio of tokens per second (document tokens, EOS not counted).

By default ours runs as the pipeline does (``executor.workers: 2``: shard pieces encoded on two threads
that share one tokenizer) and the baseline uses every core through the tokenizers thread pool.
``--workers 1`` runs ours one piece after another (each call on the tokenizers thread pool). Ours
runs in this process either way, so its CPU time covers all its work: the tokens-per-CPU-second
ratio is printed too.

    .venv/bin/python benchmarks/tokenize.py [--docs 20000] [--shards 4] [--workers 2] [--repeat 5]
"""

from __future__ import annotations

import os
import sys

# This file is named like the standard library's ``tokenize``: drop its folder from the import path
# before anything imports ``tokenize`` (linecache, inspect, ...).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from llmpipe.document import Document, write_shard  # noqa: E402
from llmpipe.executor import LocalExecutor
from llmpipe.stage import STAGES, StageContext  # noqa: E402
from llmpipe.store import ArtifactStore  # noqa: E402
from llmpipe.tokenization.config import TokenizeConfig, TokenizerConfig  # noqa: E402
from llmpipe.tokenization.stage import run_tokenize  # noqa: E402
from llmpipe.tokenization.tokenizer import load_for_encoding, save, train_bpe, wrap  # noqa: E402

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but "
         "have an they you were her she there been one all we their has would when if so no will can more "
         "river city market winter garden letter window music history science language government").split()
HANZI = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后"


def make_docs(n: int, seed: int = 0) -> list[Document]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        if rng.random() < 0.8:
            text = " ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20))).capitalize() + "."
                            for _ in range(rng.randint(2, 12)))
            lang = "en"
        else:
            text = "".join("".join(rng.choice(HANZI) for _ in range(rng.randint(6, 30))) + "。"
                           for _ in range(rng.randint(2, 10)))
            lang = "zh"
        docs.append(Document(f"doc{i}", text, "bench", {"lang": lang}))
    return docs


def bare(tok_dir: Path, texts: list[str]) -> tuple[int, float, float, float]:
    """(tokens, seconds, CPU seconds, seconds of the encode_batch call alone)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    t0, c0 = time.perf_counter(), time.process_time()
    encs = tok.encode_batch(texts, add_special_tokens=False)
    call = time.perf_counter() - t0
    ids = [e.ids for e in encs]
    del encs  # the Encoding objects are released here, as in ``[e.ids for e in tok.encode_batch(...)]``
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    return sum(map(len, ids)), secs, cpu, call


def ours(root: Path, run: int, src: Path, tok_dir: Path, workers: int) -> tuple[int, float, float]:
    out = root / f"out-{run}"
    out.mkdir()
    ctx = StageContext(spec=STAGES["tokenize"], config=TokenizeConfig(seq_len=1024, val_fraction=0.01),
                       pipeline=None, key="bench", out=out, inputs={"augment": src, "tokenizer": tok_dir},
                       input_keys={"augment": "a", "tokenizer": "t"}, store=ArtifactStore(root / f"store-{run}"),
                       executor=LocalExecutor(workers))
    t0, c0 = time.perf_counter(), time.process_time()
    stats = run_tokenize(ctx)
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    return stats["tokens_encoded"] - stats["kept"], secs, cpu  # minus one EOS per document


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2, help="shard processes for ours (executor.workers)")
    ap.add_argument("--repeat", type=int, default=5, help="best of N runs per side (interleaved)")
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    args = ap.parse_args()
    if args.quick:
        args.docs, args.repeat = 600, 1
    docs = make_docs(args.docs)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = root / "augment"
        per = -(-len(docs) // args.shards)
        for i in range(args.shards):
            write_shard(src / "shards" / f"part-{i:03d}.parquet", docs[i * per : (i + 1) * per])
        tok_dir = root / "tokenizer"
        tok_dir.mkdir()
        cfg = TokenizerConfig(vocab_size=8192)
        save(wrap(train_bpe(iter([d.text for d in docs[:5000]]), cfg), cfg), tok_dir, "trained")
        load_for_encoding(tok_dir)
        texts = [d.text for d in docs]
        base_best = ours_best = base_cpu = ours_cpu = call_best = float("inf")
        n_base = n_ours = 0
        for r in range(args.repeat):  # interleaved, best of N: a busy machine slows both sides alike
            n_base, s, c, call = bare(tok_dir, texts)
            base_best, base_cpu, call_best = min(base_best, s), min(base_cpu, c), min(call_best, call)
            n_ours, s, c = ours(root, r, src, tok_dir, args.workers)
            ours_best, ours_cpu = min(ours_best, s), min(ours_cpu, c)
        if n_base != n_ours:
            raise SystemExit(f"token counts differ: bare {n_base}, ours {n_ours}")
        base_tps, ours_tps = n_base / base_best, n_ours / ours_best
        print(f"docs={len(docs)} tokens={n_base} workers={args.workers} cpus={os.cpu_count()}")
        print(f"bare tokenizers encode_batch: {base_tps:,.0f} tokens/s ({base_best:.3f}s, cpu {base_cpu:.3f}s; "
              f"the call alone {call_best:.3f}s: ratio to it {n_ours / ours_best / (n_base / call_best):.3f})")
        print(f"llmpipe tokenize-and-pack:    {ours_tps:,.0f} tokens/s ({ours_best:.3f}s, cpu {ours_cpu:.3f}s)")
        print(f"tokens per CPU-second ratio: {base_cpu / ours_cpu:.3f}")  # both in-process: all the work
        print(f"RESULT tokenize_throughput_ratio {ours_tps / base_tps:.3f} goal >= 0.8")


if __name__ == "__main__":
    main()
