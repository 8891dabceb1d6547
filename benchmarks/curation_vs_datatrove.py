"""Curation chain vs datatrove on real text: throughput and keep/drop agreement, rule by rule.

Chain (both sides, same order, same published thresholds): language ID (lid.176.ftz, keep en at
0.65) -> Gopher quality -> Gopher repetition -> C4 -> FineWeb -> MinHash near-dedup (word 5-grams,
the same bands x rows: what our defaults give, 28 x 9 for threshold 0.8 with 256 permutations).

The corpus is real text that every install has, offline (no synthetic vocabulary: a ~100-word one
could not show where the rules differ):

- the built-in corpus of ``configs/tiny.yaml`` (``builtin:tiny``: Python's docs from ``pydoc_data``,
  the prose of stdlib docstrings, the built-in multilingual sample with its translated manual pages,
  the planted junk and copies);
- every docstring of 20+ words in the standard library's sources, as written (line breaks, lists,
  doctests, tables: technical English, much of it code-like), one document each;
- 40 documents per language of 2-5 paragraphs of the multilingual sample (de, es, fr, ja, ru, zh, en);
- then planted copies: ~8% near copies of an earlier document (about one token in 120 swapped for
  another token of the same document) and ~2% exact copies.

``--docs 0`` (the default) takes every real document once (~4.6k documents with the copies, on
CPython 3.11); a larger ``--docs`` adds documents of 2-4 paragraphs of real documents of one group.

Each side runs the way its users run it, in its own fresh process, one worker:

- ours: the real ``langid`` -> ``quality`` -> ``dedup`` stages over Parquet shards (what ingest
  writes), each writing kept and rejected shards, funnels and the dedup index;
- datatrove: ``LocalPipelineExecutor`` (tasks=1, workers=1) with ``JsonlReader`` -> its filters, each
  with an exclusion writer (as in its FineWeb example) -> ``JsonlWriter`` -> ``MinhashDedupSignature``,
  then ``MinhashDedupBuckets`` (one task per bucket, run one after the other), ``MinhashDedupCluster``
  and ``JsonlReader`` -> ``MinhashDedupFilter`` -> ``JsonlWriter``, chained with ``depends=``.

datatrove lives in its own virtual environment under ``.bench/datatrove-venv`` (git-ignored, created
on first run with ``pip install datatrove[processing] spacy orjson``; never a project dependency;
measured with datatrove 0.10.1, spaCy 3.8). Its language filter loads the same lid.176.ftz through
its own asset cache (``FT176LID.MODEL_URL`` points at the local file; no download).

Timing: from the first stage to the last output, after the top-level imports; each side's lazy imports
(ours: fasttext-new, datasketch, Pillow for the funnel charts, numba where the text to sign is large enough to repay
it; datatrove: spaCy) fall inside, as they do for a user. Throughput uses CPU seconds of the process *and its
children* (``getrusage`` SELF + CHILDREN: datatrove's executor starts a multiprocessing manager process
per step), so a busy shared machine distorts the ratio less than wall time would; wall time is printed.
At ~4.6k short documents, fixed costs (imports, model load, charts) are a large share of our time;
``--docs 20000`` shows the per-document ratio better. Language ID scores each whole text on both
sides with the same lid.176.ftz and the same answers bit for bit: ours in fasttext-new (Rust, ~0.08 us
per character), datatrove's in the C++ fastText binding (fasttext-numpy2-wheel; fasttext-predict, the
same C++, takes ~0.25 us).

Agreement: per rule filter on every document independently (each filter's own definition, untimed
second pass, English settings on both sides), the rule chain's keep/drop (before dedup), dedup
(removed as a duplicate or not, on the documents both sides passed to dedup), and the whole chain's
final keep/drop. The documents on which a rule disagrees go to ``.bench/curation/disagreements.json``.
Deviations (listed with their reasons in :mod:`llmpipe.curation.quality`): words come from a regex
close to spaCy's English tokenizer, not spaCy itself; on prose (the multilingual sample, Python's
docs prose) the rules agree, on code-like docstrings the word split differs (identifiers with
underscores, calls such as ``Decimal('1.5')``, runs of ``-``, contractions spaCy splits as ``do n't``,
``e.g.``) and the Gopher rules near their thresholds (alpha-word share 0.8, top n-gram shares) flip.
CJK documents are judged on segmented words on purpose. Dedup verifies each candidate pair's exact
Jaccard (>= 0.8), where datatrove removes every MinHash candidate, so datatrove removes a few more.

    .venv/bin/python benchmarks/curation_vs_datatrove.py [--docs 0]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # benchmarks/ shadows stdlib names
ROOT = _HERE.parent
sys.path.insert(0, str(ROOT))

BENCH = ROOT / ".bench" / "curation"
VENV = ROOT / ".bench" / "datatrove-venv"
ASSETS = ROOT / ".bench" / "hf-assets"
RULES = ("gopher_quality", "gopher_repetition", "c4", "fineweb")
SHARD_DOCS = 5000

NEAR_SHARE, EXACT_SHARE = 0.08, 0.02
LANG_MIXES = 40  # per language of the multilingual sample: documents of 2-5 of its paragraphs
SKIP_DIRS = ("site-packages", "test", "tests", "idlelib", "lib2to3")


# -- the corpus: real text ------------------------------------------------------------------------------

def stdlib_docstrings() -> list[str]:
    """Every docstring of 20+ words in the standard library's sources, as written (line breaks, lists,
    doctests and all), each once, in path order: real English technical text that every CPython
    install has (read with :mod:`ast`; nothing is imported)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if any(part in SKIP_DIRS for part in path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= 20 and doc not in seen:
                    seen.add(doc)
                    out.append(doc)
    return out


def multilingual_mixes(rng: random.Random) -> list[tuple[str, str]]:
    """(language, text): documents of 2-5 paragraphs of one language of the built-in multilingual
    sample (real sentences, new combinations)."""
    from llmpipe.data.multilingual import SAMPLES

    out = []
    for lang, paras in sorted(SAMPLES.items()):
        sep = "" if lang in ("zh", "ja") else "\n\n"
        out += [(lang, sep.join(rng.sample(paras, rng.randint(2, min(5, len(paras)))))) for _ in range(LANG_MIXES)]
    return out


def real_documents(rng: random.Random) -> list[tuple[str, str]]:
    """(group, text) for every real document: the built-in corpus of ``configs/tiny.yaml`` (Python's
    docs, stdlib docstring prose, the multilingual sample, the planted junk and copies), every stdlib
    docstring as written, and multilingual mixes. group: ``en``, ``planted`` or the sample's language."""
    from llmpipe.data.builtin_corpus import build

    out = []
    for part, docs in build("tiny").items():
        for d in docs:
            group = d.get("lang_hint") or ("planted" if part == "planted.jsonl" else "en")
            out.append((group, d["text"]))
    out += [("en", t) for t in stdlib_docstrings()]
    return out + multilingual_mixes(rng)


def near_copy(rng: random.Random, text: str) -> str:
    """About one space-separated token in 120 swapped for another token of the same document
    (an edited copy: Jaccard of 5-gram shingles ~0.85-0.95; the text's statistics barely move)."""
    toks = text.split(" ")
    for pos in rng.sample(range(len(toks)), max(1, len(toks) // 120)):
        toks[pos] = rng.choice(toks)
    return " ".join(toks)


def make_corpus(n: int, seed: int = 1234) -> tuple[list[str], list[str], dict[int, tuple[str, int]]]:
    """Texts, their groups, and the planted duplicates: index -> ("near" | "exact", index of its source).

    ``n`` = 0: every real document once (in a seeded order), plus planted copies. A smaller ``n``
    samples the real documents; a larger one adds documents of 2-4 paragraphs of different real
    documents of the same group."""
    rng = random.Random(seed)
    pool = real_documents(rng)
    rng.shuffle(pool)
    texts: list[str] = []
    groups: list[str] = []
    originals: list[int] = []
    planted: dict[int, tuple[str, int]] = {}
    fresh = iter(pool)
    while len(texts) < (n or len(pool) * 2):
        i, r = len(texts), rng.random()
        if originals and i >= 100 and r < NEAR_SHARE + EXACT_SHARE:
            src = rng.choice(originals)
            kind = "near" if r < NEAR_SHARE else "exact"
            texts.append(near_copy(rng, texts[src]) if kind == "near" else texts[src])
            groups.append(groups[src])
            planted[i] = (kind, src)
            continue
        group, text = next(fresh, ("", ""))
        if not group and not n:
            break
        if not group:  # past the pool: paragraphs of real documents of one group, recombined
            group = rng.choice(("en", "en", "en", "de", "fr", "es", "ru"))
            same = [t for g, t in pool if g == group]
            text = "\n\n".join(p for t in rng.sample(same, rng.randint(2, 4)) for p in t.split("\n\n")[:3])
        texts.append(text)
        groups.append(group)
        originals.append(i)
    return texts, groups, planted


def write_inputs(texts: list[str], root: Path) -> tuple[Path, Path]:
    """The corpus as JSONL (datatrove's reader) and as Parquet shards (our ingest's output)."""
    from llmpipe.document import Document, write_shard

    if root.exists():
        shutil.rmtree(root)
    jsonl_dir, shards = root / "jsonl", root / "parquet"
    jsonl_dir.mkdir(parents=True)
    with open(jsonl_dir / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": str(i), "text": t}, ensure_ascii=False) + "\n")
    for s in range(0, len(texts), SHARD_DOCS):
        docs = [Document(str(i), texts[i], "bench", {}) for i in range(s, min(len(texts), s + SHARD_DOCS))]
        write_shard(shards / "shards" / f"part-{s // SHARD_DOCS:05d}.parquet", docs)
    return jsonl_dir, shards


def cpu_seconds() -> float:
    """User + system CPU of this process and of its waited-for children."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


# -- our side (a child process of this script) ----------------------------------------------------------

def _run_stage(name: str, cfg: Any, inputs: dict[str, Path], store: Any, work: Path) -> Path:
    """One registered stage, called the way the DAG calls it (one in-process shard worker)."""
    from llmpipe.executor import LocalExecutor
    from llmpipe.stage import STAGES, StageContext

    out = work / name
    out.mkdir(parents=True)
    ctx = StageContext(spec=STAGES[name], config=cfg, pipeline=None, key=f"bench-{name}", out=out,
                       inputs=inputs, input_keys={k: "bench" for k in inputs}, store=store,
                       executor=LocalExecutor(1))
    STAGES[name].fn(ctx)
    return out


def _rejected(stage_dir: Path, label: str | None) -> dict[str, str]:
    """id -> reason for the documents a stage rejected (``label`` or the filter that rejected it)."""
    from llmpipe.document import iter_documents

    out = {}
    for p in sorted((stage_dir / "rejected").glob("*.parquet")):
        for d in iter_documents(p):
            out[d.id] = label or d.metadata["rejected_by"]
    return out


def ours_child(shards: Path, work: Path, result: Path) -> None:
    import llmpipe.curation.dedup.stage  # noqa: F401  (registers the stage)
    import llmpipe.curation.stages  # noqa: F401
    from llmpipe.curation.config import DedupConfig, LangIdConfig, QualityConfig
    from llmpipe.curation.quality import build_quality_filters
    from llmpipe.document import Document, iter_documents, shard_paths
    from llmpipe.stage import STAGES
    from llmpipe.store import ArtifactStore

    store = ArtifactStore(work / "store")
    lid_cfg = LangIdConfig(languages=["en"], detect_code=False, min_chars=0, max_chars=0)
    w0, c0 = time.perf_counter(), cpu_seconds()
    lid = _run_stage("langid", lid_cfg, {"ingest": shards}, store, work)
    qual = _run_stage("quality", QualityConfig(), {"langid": lid}, store, work)
    dedup = _run_stage("dedup", DedupConfig(incremental=False), {STAGES["dedup"].inputs[0]: qual}, store, work)
    wall, cpu = time.perf_counter() - w0, cpu_seconds() - c0

    final: dict[str, str | None] = {**_rejected(lid, "langid"), **_rejected(qual, None), **_rejected(dedup, "dedup")}
    for p in shard_paths(dedup):
        final.update({d.id: None for d in iter_documents(p)})
    texts = [d.text for p in shard_paths(shards) for d in iter_documents(p)]
    rules = build_quality_filters(QualityConfig())  # untimed: every rule on every doc
    per_rule = {f.name: [f.filter(Document("x", t, "b", {})) is True for t in texts] for f in rules}
    result.write_text(json.dumps({"wall": wall, "cpu": cpu, "final": final, "per_rule": per_rule}))


# -- datatrove's side (runs in its own venv) --------------------------------------------------------------

DATATROVE_SIDE = r'''
import gzip, json, resource, sys, time
from pathlib import Path
from datatrove.executor import LocalPipelineExecutor
from datatrove.data import Document
from datatrove.pipeline.dedup import (MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter,
                                      MinhashDedupSignature)
from datatrove.pipeline.dedup.minhash import MinhashConfig
from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter, GopherQualityFilter,
                                        GopherRepetitionFilter, LanguageFilter)
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.lid import FT176LID

corpus, work, model, bands, rows, out = sys.argv[1:7]
FT176LID.MODEL_URL = model  # the same lid.176.ftz, through datatrove's own asset cache (no download)
cfg = MinhashConfig(n_grams=5, num_buckets=int(bands), hashes_per_bucket=int(rows), seed=1)
w = Path(work)
RULES = [("gopher_quality", GopherQualityFilter), ("gopher_repetition", GopherRepetitionFilter),
         ("c4", C4QualityFilter), ("fineweb", FineWebQualityFilter)]

def excl(name):
    return JsonlWriter(str(w / "removed" / name))

def cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

filters = [LanguageFilter(languages=["en"], language_threshold=0.65, exclusion_writer=excl("langid"))]
filters += [cls(exclusion_writer=excl(name)) for name, cls in RULES]
s1 = LocalPipelineExecutor([JsonlReader(corpus), *filters, JsonlWriter(str(w / "filtered")),
                            MinhashDedupSignature(output_folder=str(w / "sigs"), config=cfg)],
                           tasks=1, workers=1, logging_dir=str(w / "logs" / "s1"))
s2 = LocalPipelineExecutor([MinhashDedupBuckets(input_folder=str(w / "sigs"), output_folder=str(w / "buckets"),
                                                config=cfg)],
                           tasks=cfg.num_buckets, workers=1, logging_dir=str(w / "logs" / "s2"), depends=s1)
s3 = LocalPipelineExecutor([MinhashDedupCluster(input_folder=str(w / "buckets"), output_folder=str(w / "remove"),
                                                config=cfg)],
                           tasks=1, workers=1, logging_dir=str(w / "logs" / "s3"), depends=s2)
s4 = LocalPipelineExecutor([JsonlReader(str(w / "filtered")),
                            MinhashDedupFilter(input_folder=str(w / "remove"), exclusion_writer=excl("dedup")),
                            JsonlWriter(str(w / "output"))],
                           tasks=1, workers=1, logging_dir=str(w / "logs" / "s4"), depends=s3)
w0, c0 = time.perf_counter(), cpu()
s4.run()
wall, secs = time.perf_counter() - w0, cpu() - c0

def ids(folder):
    out = []
    for p in sorted(Path(folder).glob("*.jsonl.gz")):
        with gzip.open(p, "rt", encoding="utf-8") as f:
            out += [json.loads(line)["id"] for line in f]
    return out

final = {}
for name in ["langid", *[n for n, _ in RULES], "dedup"]:
    final.update({i: name for i in ids(w / "removed" / name)})
final.update({i: None for i in ids(w / "output")})

# untimed: every rule on every doc; docs outer so the four filters share datatrove's tokenization cache,
# a fresh Document per filter because C4 rewrites doc.text (drops lines)
texts = [json.loads(line)["text"] for line in open(Path(corpus) / "corpus.jsonl", encoding="utf-8")]
rules = [(name, cls()) for name, cls in RULES]
per_rule = {name: [] for name, _ in RULES}
for t in texts:
    for name, f in rules:
        try:
            r = f.filter(Document(text=t, id="x"))
            keep = r[0] if isinstance(r, tuple) else bool(r)
        except ZeroDivisionError:  # FineWeb divides by the word count; empty texts never reach it in the chain
            keep = False
        per_rule[name].append(keep)
json.dump({"wall": wall, "cpu": secs, "final": final, "per_rule": per_rule}, open(out, "w"))
'''


def ensure_datatrove_venv() -> Path:
    py = VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    probe = subprocess.run([str(py), "-c", "import datatrove, spacy, fasttext, orjson"], capture_output=True)
    if probe.returncode != 0:
        subprocess.run([str(py), "-m", "pip", "install", "-q", "datatrove[processing]", "spacy", "orjson"],
                       check=True)  # orjson: datatrove's JsonlReader/JsonlWriter
    return py


def run_datatrove(jsonl_dir: Path, work: Path, bands: int, rows: int) -> dict[str, Any]:
    from llmpipe.curation.langid import default_model_path

    py = ensure_datatrove_venv()
    script, out = BENCH / "datatrove_side.py", BENCH / "datatrove-result.json"
    script.write_text(DATATROVE_SIDE)
    env = {**os.environ, "HF_ASSETS_CACHE": str(ASSETS)}
    with open(BENCH / "datatrove.log", "w") as log:
        subprocess.run([str(py), str(script), str(jsonl_dir), str(work), str(default_model_path()), str(bands),
                        str(rows), str(out)], check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    return json.loads(out.read_text())


def run_ours(shards: Path, work: Path) -> dict[str, Any]:
    out = BENCH / "ours-result.json"
    with open(BENCH / "ours.log", "w") as log:
        subprocess.run([sys.executable, __file__, "--child", str(shards), str(work), str(out)], check=True,
                       stdout=log, stderr=subprocess.STDOUT)
    return json.loads(out.read_text())


# -- the report -----------------------------------------------------------------------------------------------

def _share(pairs: list[tuple[bool, bool]]) -> float:
    return sum(a == b for a, b in pairs) / max(1, len(pairs))


def report(texts: list[str], groups: list[str], planted: dict[int, tuple[str, int]], ours: dict, theirs: dict) -> None:
    from llmpipe.curation.text import is_cjk_doc

    n = len(texts)
    ids = [str(i) for i in range(n)]
    a, b = ours["final"], theirs["final"]
    assert len(a) == n and len(b) == n, f"decisions missing: ours {len(a)}, datatrove {len(b)} of {n}"
    langs = sorted(set(groups) - {"en", "planted"})
    print(f"docs={n}: {groups.count('en')} English (Python's docs, docstrings), {groups.count('planted')} "
          f"planted junk, {sum(g in langs for g in groups)} multilingual ({', '.join(langs)}); planted: "
          f"{sum(k == 'near' for k, _ in planted.values())} near copies, "
          f"{sum(k == 'exact' for k, _ in planted.values())} exact copies")
    for side, d in (("ours", a), ("datatrove", b)):
        counts = {r: sum(v == r for v in d.values()) for r in ("langid", *RULES, "dedup")}
        print(f"  {side:9s} kept {sum(v is None for v in d.values()):6d}  dropped by " +
              ", ".join(f"{k} {v}" for k, v in counts.items()))
    # CJK documents are judged differently on purpose (Sudachi / jieba words; datatrove's English
    # tokenizer sees one "word" per clause), so rule agreement is reported with and without them.
    spaced = [i for i, t in enumerate(texts) if not is_cjk_doc(t, None)]
    multi = [i for i in spaced if groups[i] not in ("en", "planted")]
    rule_agree = []
    disagree: dict[str, list[dict[str, Any]]] = {}
    for name in RULES:
        x, y = ours["per_rule"][name], theirs["per_rule"][name]
        agree_sp = _share([(x[i], y[i]) for i in spaced])
        rule_agree.append(agree_sp)
        print(f"  {name:18s} agreement all docs {_share(list(zip(x, y, strict=True))):.4f}, non-CJK docs "
              f"{agree_sp:.4f} (multilingual non-CJK {_share([(x[i], y[i]) for i in multi]):.4f} of {len(multi)})"
              f"  kept ours={sum(x)} datatrove={sum(y)}")
        disagree[name] = [{"doc": i, "group": groups[i], "ours": x[i], "datatrove": y[i], "text": texts[i][:3000]}
                          for i in spaced if x[i] != y[i]]
    (BENCH / "disagreements.json").write_text(json.dumps(disagree, ensure_ascii=False, indent=1))
    by_rules = {i: (a[i] not in (None, "dedup"), b[i] not in (None, "dedup")) for i in ids}
    both_in = [i for i in ids if not any(by_rules[i])]
    both_set = set(both_in)
    dedup_pairs = [(a[i] == "dedup", b[i] == "dedup") for i in both_in]
    print(f"rule chain keep/drop agreement {_share(list(by_rules.values())):.4f} "
          f"({n - len(spaced)} CJK docs of {n})")
    print(f"dedup agreement {_share(dedup_pairs):.4f} on the {len(both_in)} docs both sides passed to dedup "
          f"(removed: ours {sum(p[0] for p in dedup_pairs)}, datatrove {sum(p[1] for p in dedup_pairs)}, "
          f"both {sum(p[0] and p[1] for p in dedup_pairs)})")
    for kind in ("near", "exact"):
        hits = [str(i) for i, (k, src) in planted.items() if k == kind and str(i) in both_set
                and a[str(src)] is None and b[str(src)] is None]
        print(f"  planted {kind} copies whose source both kept: {len(hits)}; removed by ours "
              f"{sum(a[i] == 'dedup' for i in hits)}, by datatrove {sum(b[i] == 'dedup' for i in hits)}")
    print(f"whole chain keep/drop agreement {_share([(a[i] is None, b[i] is None) for i in ids]):.4f}")
    our_rate, their_rate = n / ours["cpu"], n / theirs["cpu"]
    print(f"throughput, CPU s (self + children): ours {ours['cpu']:.1f}s = {our_rate:,.0f} docs/s, datatrove "
          f"{theirs['cpu']:.1f}s = {their_rate:,.0f} docs/s")
    print(f"wall: ours {ours['wall']:.1f}s, datatrove {theirs['wall']:.1f}s "
          f"(ratio {theirs['wall'] / ours['wall']:.2f}; shared machine, CPU ratio is the figure)")
    print(f"RESULT curation_rule_agreement_non_cjk_min {min(rule_agree):.4f} goal >= 0.99")
    print(f"RESULT curation_throughput_ratio {our_rate / their_rate:.2f} goal >= 10")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=0, help="0 (default): every real document once, plus planted copies")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    args = ap.parse_args()
    if args.quick:
        args.docs = 300
    if args.child:
        ours_child(Path(args.child[0]), Path(args.child[1]), Path(args.child[2]))
        return
    from llmpipe.curation.config import DedupConfig
    from llmpipe.curation.dedup.lsh import lsh_params

    d = DedupConfig()
    bands, rows = lsh_params(d.threshold, d.num_perm, d.bands, d.rows, d.false_positive_weight,
                             d.false_negative_weight)
    texts, groups, planted = make_corpus(args.docs)
    jsonl_dir, shards = write_inputs(texts, BENCH / "input")
    work = BENCH / "work"
    for side in ("ours", "datatrove"):
        if (work / side).exists():
            shutil.rmtree(work / side)
    theirs = run_datatrove(jsonl_dir, work / "datatrove", bands, rows)
    ours = run_ours(shards, work / "ours")
    report(texts, groups, planted, ours, theirs)


if __name__ == "__main__":
    main()
