"""MinHash signatures/s: llmpipe's vectorized kernel vs datasketch (and rensa) on the same documents.

Both sides start from raw text and produce identical signatures (checked here): datasketch gets
our reference shingler (same normalization and shingles), then ``MinHash.update_batch`` per
document, or ``MinHash.bulk``. Also printed: the datasketch figure with shingling excluded.

rensa (a Rust MinHash on the package index, in the ``[test]`` extra; skipped with a note when it is
not installed) gets the same shingles, as bytes, through ``RMinHash.update`` per document: its own
hash functions, so its signatures differ from datasketch's (ours are bit-identical to datasketch's).
It is timed from raw text like the others (our shingler in Python, then rensa), and pre-shingled.

    python benchmarks/minhash.py [--docs 2000] [--words 300] [--num-perm 256]
"""

from __future__ import annotations

import sys
from pathlib import Path

# benchmarks/ holds scripts named like stdlib modules (tokenize.py): keep it off the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from datasketch import MinHash  # noqa: E402

from llmpipe.curation.dedup.minhash import HAVE_NUMBA, signatures  # noqa: E402
from llmpipe.curation.dedup.text import shingles  # noqa: E402

try:  # a peer, not a dependency of the library
    import rensa  # noqa: E402
except ImportError:  # pragma: no cover - the [test] extra installs it
    rensa = None


def corpus(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 10)))
             for _ in range(20_000)]
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(words // 2, words * 3 // 2))) for _ in range(n)]


def best_of(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--words", type=int, default=300)
    ap.add_argument("--num-perm", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    a = ap.parse_args()
    if a.quick:
        a.docs, a.repeat = 100, 1
    texts = corpus(a.docs, a.words)
    P = a.num_perm
    signatures(texts[:2], num_perm=P)  # compile / load the numba kernel outside the timing

    def ds_update_batch():
        out = []
        for t in texts:
            m = MinHash(num_perm=P, seed=1)
            m.update_batch(shingles(t))
            out.append(m.hashvalues)
        return np.array(out)

    def ds_bulk():
        return np.array([m.hashvalues for m in MinHash.bulk([shingles(t) for t in texts], num_perm=P, seed=1)])

    pre = [shingles(t) for t in texts]

    def ds_update_batch_preshingled():
        out = []
        for sh in pre:
            m = MinHash(num_perm=P, seed=1)
            m.update_batch(sh)
            out.append(m.hashvalues)
        return np.array(out)

    def rensa_sigs(shingled):
        out = []
        for sh in shingled:
            m = rensa.RMinHash(num_perm=P, seed=1)
            m.update(sh)
            out.append(m.digest())
        return out

    t_ours, ours = best_of(lambda: signatures(texts, num_perm=P), a.repeat)
    t_np, ours_np = best_of(lambda: signatures(texts, num_perm=P, backend="numpy"), a.repeat)
    t_ub, ref = best_of(ds_update_batch, a.repeat)
    t_bulk, ref_bulk = best_of(ds_bulk, a.repeat)
    t_pre, _ = best_of(ds_update_batch_preshingled, a.repeat)
    assert (ours == ref).all() and (ours_np == ref).all() and (ref_bulk == ref).all(), "signatures differ"
    n = len(texts)
    print(f"docs={n} num_perm={P} shingles={sum(map(len, pre))} numba={HAVE_NUMBA}  (signatures bit-identical)")
    for name, t in [("llmpipe (numba)" if HAVE_NUMBA else "llmpipe", t_ours), ("llmpipe numpy fallback", t_np),
                    ("datasketch update_batch", t_ub), ("datasketch bulk", t_bulk),
                    ("datasketch update_batch, pre-shingled", t_pre)]:
        print(f"{name:40s} {n / t:10.0f} docs/s")
    if rensa is not None:
        t_rensa, _ = best_of(lambda: rensa_sigs([shingles(t) for t in texts]), a.repeat)
        t_rensa_pre, _ = best_of(lambda: rensa_sigs(pre), a.repeat)
        print(f"{'rensa RMinHash ' + rensa.__version__ if hasattr(rensa, '__version__') else 'rensa RMinHash':40s} "
              f"{n / t_rensa:10.0f} docs/s   pre-shingled: {n / t_rensa_pre:.0f} docs/s")
        print(f"RESULT minhash_speedup_vs_rensa {t_rensa / t_ours:.2f} goal >= 1")
    else:
        print("rensa is not installed (pip install rensa, or the [test] extra): its figure is skipped")
    print(f"ratio vs update_batch: {t_ub / t_ours:.2f}x  vs bulk: {t_bulk / t_ours:.2f}x  "
          f"vs pre-shingled update_batch: {t_pre / t_ours:.2f}x  numpy fallback vs update_batch: {t_ub / t_np:.2f}x")
    print(f"RESULT minhash_speedup_vs_update_batch {t_ub / t_ours:.2f} goal >= 5")


if __name__ == "__main__":
    main()
