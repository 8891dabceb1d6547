"""Curation at corpus scale: peak memory and wall time per stage at growing corpus sizes (issue 30).

For each size (default 100k, 500k, 2M documents) a fresh process generates a deterministic corpus
and runs ingest -> langid -> quality -> ... -> dedup through the library DAG (``plan`` + ``execute``,
what ``llmpipe run`` does for each stage, the pass-through stages between them included) into a
fresh store, with the local executor's worker processes. Per stage it records wall seconds and the
peak resident memory of the whole process tree (this process and its shard workers, sampled every
20 ms with psutil; ``ru_maxrss`` of the process and of its reaped children is printed beside it as
a check the sampler cannot miss a spike of the driver).

The corpus is realistic mixed text: each document is three to five paragraphs of three to six
English sentences (prose from Python's bundled documentation, ~450 distinct sentences)
in a random order, plus a document number; mixed into it:

- 2% exact duplicates of an earlier document,
- 3% near duplicates (one word in ~100 replaced: 5-shingle Jaccard ~0.9),
- 1% one boilerplate cluster of many near-identical pages (the same ~300-word page, one word
  different per page): the case where all-pairs LSH candidates grow with the square of a bucket,
- 1% short non-English documents (German and French sentences) that langid drops.

Memory should be flat, bounded by the stages' budgets rather than the corpus size:
``RESULT scale_memory_growth <peak RSS at the largest size / peak at the smallest> goal <= 1.5``.
The dedup backend defaults to ``external`` (out of core, ``memory_budget_mb`` bounds a partition);
``--backend memory`` measures the in-memory index, which grows with the corpus by design.
``--no-filters`` runs quality and safety with no filters (their stages pass the shards through as
hard links; langid still runs): dedup at a size where the filters' per-document CPU does not fit the
time at hand. Each stage prints a ``STAGE`` line as it ends, so a run stopped for time still tells
how far it got.

    .venv/bin/python benchmarks/scale.py [--sizes 100000,500000,2000000] [--workers 2] [--backend external]
"""

from __future__ import annotations

import os
import sys

# benchmarks/tokenize.py would shadow the stdlib module: drop this folder from the import path first
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import psutil  # noqa: E402

# langid through dedup in DAG order (the quality-dimension and entity stages between them pass through when off)
CURATION = ("langid", "quality", "coherence", "expertise", "safety", "entities", "dedup")
FOREIGN = (
    "Der Fluss fließt langsam durch die alte Stadt, und am Morgen gehen die Menschen über die Brücke zur Arbeit.",
    "Im Winter ist es im Norden sehr kalt, aber die Bibliothek bleibt jeden Tag bis zum späten Abend geöffnet.",
    "Le conseil municipal a décidé de rénover la gare et le musée avant la fin de l'année prochaine.",
    "Les habitants du village traversent le pont chaque matin pour acheter du pain frais au marché.",
)
SHARD_DOCS = 20_000  # rows per source file (a crawl's part files)


def _prose(s: str) -> bool:
    """Running prose, not code or a grammar rule: what a quality filter should keep."""
    from llmpipe.curation.text import split_words

    if len(s.split()) < 6 or not s.endswith(".") or re.search(r"[>{}\[\]=*_`]|::", s):
        return False
    words = split_words(s, "en")  # punctuation counts as words, as in Gopher's alpha rule
    return sum(any(c.isalpha() for c in w) for w in words) / len(words) >= 0.88


def sentences() -> list[str]:
    """English prose sentences from Python's bundled docs (real text, no download; ~450 of them).

    Documents are built from sentences, so two documents rarely share more than one or two (built
    from whole paragraphs of a small pool, many pairs of documents would share half their text and
    LSH candidates would grow with the square of the corpus)."""
    from pydoc_data.topics import topics

    paras = (" ".join(p.split()) for t in topics.values() for p in t.split("\n\n"))
    return sorted({s.strip() for p in paras for s in re.split(r"(?<=\.) (?=[A-Z])", p) if _prose(s.strip())})


def _doc_text(rng: random.Random, sents: list[str], n: int) -> str:
    paras = (" ".join(rng.sample(sents, rng.randint(3, 6))) for _ in range(rng.randint(3, 5)))
    return "\n\n".join(paras) + f"\n\nDocument {n}."


def _near(rng: random.Random, text: str) -> str:
    words = text.split(" ")
    for pos in rng.sample(range(len(words)), max(1, len(words) // 100)):  # Jaccard ~0.9: a near copy
        words[pos] = f"x{rng.randrange(10**9)}"
    return " ".join(words)


def make_corpus(root: Path, docs: int, shard_docs: int = SHARD_DOCS, seed: int = 0) -> dict[str, int]:
    """JSONL part files of ``docs`` documents; returns the planted counts. Streams: O(1) memory
    beyond a bounded pool of earlier texts to copy from."""
    sents = sentences()
    rng = random.Random(seed)
    page = " ".join(rng.sample(sents, 40)).split(" ")[:300]  # the boilerplate page
    pool: list[str] = []
    counts = {"exact": 0, "near": 0, "boilerplate": 0, "foreign": 0}
    root.mkdir(parents=True, exist_ok=True)
    f = None
    for n in range(docs):
        if n % shard_docs == 0:
            if f is not None:
                f.close()
            f = open(root / f"part-{n // shard_docs:05d}.jsonl", "w", encoding="utf-8")
        r = rng.random()
        if pool and r < 0.02:
            text, kind = rng.choice(pool), "exact"
        elif pool and r < 0.05:
            text, kind = _near(rng, rng.choice(pool)), "near"
        elif r < 0.06:
            text, kind = " ".join(page) + f" Page {n}.", "boilerplate"
        elif r < 0.07:
            text, kind = " ".join(rng.sample(FOREIGN, 2)) + f" {n}", "foreign"
        else:
            text, kind = _doc_text(rng, sents, n), None
            if len(pool) < 10_000:
                pool.append(text)
            else:
                pool[rng.randrange(len(pool))] = text
        if kind:
            counts[kind] += 1
        assert f is not None
        f.write(json.dumps({"id": f"d{n}", "text": text, "url": f"https://example.org/{n}"}) + "\n")
    if f is not None:
        f.close()
    return counts


class TreeSampler:
    """Peak RSS of this process plus all its descendants, sampled on a thread; ``reset`` per stage."""

    def __init__(self, interval: float = 0.02) -> None:
        self.proc = psutil.Process()
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> int:
        total = self.proc.memory_info().rss
        for child in self.proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:  # exited between the listing and the read
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._rss())

    def reset(self) -> None:
        self.peak = self._rss()

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _stage_line(docs: int, name: str, s: dict[str, float]) -> None:
    """One stage's figures as soon as it ends, so a run stopped for time still tells how far it got."""
    print(f"STAGE {docs} {name} wall {s['wall']:.2f}s driver-cpu {s['cpu']:.2f}s peak {s['peak_mb']:.0f} MiB "
          f"at {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}", flush=True)


def run_size(docs: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Generate the corpus and run the curation stages through the DAG; per-stage wall and peak RSS."""
    from llmpipe.config import load_config
    from llmpipe.dag import execute, open_store, plan
    from llmpipe.executor import LocalExecutor

    t0 = time.perf_counter()
    planted = make_corpus(tmp / "corpus", docs, args.shard_docs)
    gen_s = time.perf_counter() - t0
    print(f"STAGE {docs} generate wall {gen_s:.2f}s planted {planted}", flush=True)
    cfg = load_config(None, data={
        "name": "scale-bench", "store": str(tmp / "store"), "state_dir": str(tmp / "state"),
        "sources": [{"name": "bench", "path": str(tmp / "corpus"), "format": "jsonl"}],
        "executor": {"workers": args.workers},
        "ingest": {"max_docs_per_shard": args.shard_docs},
        "dedup": {"backend": args.backend, "memory_budget_mb": args.budget_mb},
        **({"quality": {"filters": []}, "safety": {"filters": []}} if args.no_filters else {}),
    })
    store, planned = open_store(cfg), plan(cfg)
    executor = LocalExecutor(args.workers)
    arts: dict[str, Any] = {}
    stages: dict[str, dict[str, float]] = {}
    with TreeSampler() as sampler:
        for name in ("ingest", *CURATION):
            ps = planned[name]
            sampler.reset()
            w0, c0 = time.perf_counter(), time.process_time()
            art, ran, _ = execute(cfg, store, ps, {d: arts[d] for d in ps.upstream}, executor=executor)
            assert ran, f"{name} was cached in a fresh store"
            arts[name] = art
            stages[name] = {"wall": time.perf_counter() - w0, "cpu": time.process_time() - c0,
                            "peak_mb": sampler.peak / 2**20}
            _stage_line(docs, name, stages[name])
    st = arts["dedup"].stats
    dedup = {k: st.get(k) for k in ("edges_candidate", "edges_verified", "verify_shard_reads", "id_shard_reads",
                                       "exact_run_reads", "seconds", "cpu_seconds")}
    return {"docs": docs, "gen_s": gen_s, "planted": planted, "stages": stages, "dedup": dedup,
            "ingested": arts["ingest"].stats.get("ingested"), "kept": st.get("kept"),
            "maxrss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "maxrss_children_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def child(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="llmpipe-scale-"))
    try:
        out = run_size(args.child, args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("SCALE-JSON " + json.dumps(out), flush=True)


def measure(docs: int, args: argparse.Namespace) -> dict[str, Any]:
    """One size in a fresh interpreter, so each size's peak is its own (not the previous size's)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(docs), "--workers", str(args.workers),
           "--backend", args.backend, "--budget-mb", str(args.budget_mb), "--shard-docs", str(args.shard_docs),
           *(["--no-filters"] if args.no_filters else [])]
    result = ""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:  # stderr: the parent's
        assert proc.stdout is not None
        for line in proc.stdout:  # per-stage lines pass through as they come
            if line.startswith("SCALE-JSON "):
                result = line[len("SCALE-JSON "):]
            elif line.startswith("STAGE "):
                print("   " + line.rstrip(), flush=True)
    if proc.returncode != 0 or not result:
        raise SystemExit(f"size {docs} failed (exit {proc.returncode}); its stderr is above")
    return json.loads(result)


def show(r: dict[str, Any]) -> float:
    """Print one size's rows; returns its peak RSS (MiB) over the curation stages and ingest."""
    total = sum(s["wall"] for s in r["stages"].values())
    peak = max(s["peak_mb"] for s in r["stages"].values())
    print(f"== {r['docs']:,} docs (generated in {r['gen_s']:.1f}s; planted {r['planted']}): "
          f"ingested {r['ingested']}, dedup kept {r['kept']}; {total:.1f}s wall, "
          f"{r['docs'] / total:,.0f} docs/s; peak RSS {peak:.0f} MiB (process tree)", flush=True)
    for name, s in r["stages"].items():
        print(f"   {name:10s} wall {s['wall']:8.2f}s  driver cpu {s['cpu']:8.2f}s  peak {s['peak_mb']:7.0f} MiB")
    print(f"   dedup: {r['dedup']}")
    print(f"   ru_maxrss: driver {r['maxrss_self_mb']:.0f} MiB, largest reaped child {r['maxrss_children_mb']:.0f} MiB")
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100000,500000,2000000", help="corpus sizes, comma-separated")
    ap.add_argument("--workers", type=int, default=2, help="local executor processes")
    ap.add_argument("--backend", default="external", choices=("external", "memory"), help="dedup LSH backend")
    ap.add_argument("--budget-mb", type=float, default=256, help="dedup memory_budget_mb (external backend)")
    ap.add_argument("--shard-docs", type=int, default=SHARD_DOCS, help="documents per source file and ingest shard")
    ap.add_argument("--no-filters", action="store_true",
                    help="quality and safety with no filters (they pass their shards through as hard links): "
                         "dedup at scale without the filters' per-document CPU, where the full chain does not fit")
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.shard_docs = 1000
    sizes = [1000, 4000] if args.quick else [int(s) for s in args.sizes.split(",")]
    peaks = {n: show(measure(n, args)) for n in sizes}
    lo, hi = min(sizes), max(sizes)
    growth = peaks[hi] / peaks[lo]
    print(f"peak RSS {hi:,} / {lo:,} docs: {peaks[hi]:.0f} / {peaks[lo]:.0f} MiB = {growth:.3f}x")
    print(f"RESULT scale_memory_growth {growth:.3f} goal <= 1.5")


if __name__ == "__main__":
    main()
