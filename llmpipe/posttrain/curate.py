"""Curation of instruction and preference records: the curation stages' filters, then dedup, then
decontamination, with every record ending kept or rejected with a reason.

The filters are the curation stages' own classes, built from their own config sections
(:class:`~llmpipe.curation.langid.LanguageFilter`, ``build_quality_filters``, ``build_safety_filters``)
and run through :class:`~llmpipe.curation.filters.FilterChain`, which counts reasons and quarantines a
record a filter raised on (``error:<Type>``). A record is one document whose text is all of its text:
the prompt's messages and the response (for preferences: prompt, chosen and rejected), one per line,
so language, quality and blocklist decide on the whole exchange. PII redaction (``safety.filters``
with ``pii``) rewrites text, so it runs on each field of a kept record on its own, and the record keeps
its shape. Dedup uses the dedup stage's normalization and MinHash (exact duplicates of the normalized
text, then near duplicates: shared LSH band, verified shingle Jaccard >= threshold; the first record
stays). Decontamination (:mod:`llmpipe.posttrain.decontaminate`) comes last.

The defaults are set for chat turns, which are short: the curation stages' defaults are for web pages
(Gopher's 50-word minimum would reject every built-in pair). langid scores texts of 10 or more
visible characters and keeps a language above 0.3: lid.176.ftz names the language of every built-in
pair correctly, but scores some of the shortest (``"Say this word twice: table"``) at 0.2-0.5, so the
curation stages' 0.65 would reject 8% of the built-in instruction set and 0.3 rejects one pair of 320.
Quality keeps the Gopher rules that measure junk rather than length (symbols, ellipses, bullets,
word length, repetition); C4 and FineWeb judge lines and sentences of a page and stay off.

The stage writes ``curation/kept.jsonl``, ``curation/rejected.jsonl`` (each with its ``where``: file
and line, and ``reason``) and ``curation/funnel.json``; the funnel is counted from the written files.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmpipe.curation.filters import ERROR_PREFIX  # the filters' quarantine reasons: error:<Type>
from llmpipe.posttrain.config import PostTrainCuration, PostTrainDedup
from llmpipe.posttrain.data import Pair, Preference

BAD_RECORD = "error:bad_record"  # a row that is no instruction / preference record (missing key, wrong type)
DUPLICATE, NEAR_DUPLICATE, CONTAMINATED = "duplicate", "near_duplicate", "contaminated"
FOLDER = "curation"
NUMBA_FROM = 20_000


Item = Pair | Preference


def fields(item: Item) -> list[str]:
    """The texts of a record: the prompt's messages, then the response (or chosen, rejected)."""
    tail = [item.response] if isinstance(item, Pair) else [item.chosen, item.rejected]
    return [c for _r, c in item.prompt] + tail


def _with_fields(item: Item, texts: list[str]) -> Item:
    """The record with its field texts replaced (same roles, same order as :func:`fields`)."""
    n = len(item.prompt)
    prompt = tuple((r, t) for (r, _c), t in zip(item.prompt, texts[:n], strict=True))
    if isinstance(item, Pair):
        return Pair(prompt, texts[n])
    return Preference(prompt, texts[n], texts[n + 1])


def _filters(cfg: PostTrainCuration) -> tuple[list[Any], Any]:
    """(the deciding filters, the PII redactor or None): the curation stages' classes."""
    out: list[Any] = []
    pii = None
    if cfg.langid is not None:
        from llmpipe.curation.langid import LanguageFilter

        out.append(LanguageFilter(cfg.langid))
    if cfg.quality is not None:
        from llmpipe.curation.quality import build_quality_filters

        out += build_quality_filters(cfg.quality)
    if cfg.safety is not None:
        from llmpipe.curation.safety import build_safety_filters

        for f in build_safety_filters(cfg.safety):
            if f.name == "pii":
                pii = f
            else:
                out.append(f)
    return out, pii


def run_filters(records: list[tuple[str, Item]], cfg: PostTrainCuration
                ) -> tuple[list[tuple[str, Item]], list[tuple[str, Item, str]], dict[str, int]]:
    """(kept, rejected with reason, PII redactions per type) after langid / quality / safety."""
    from llmpipe.curation.filters import FilterChain, check_error_share
    from llmpipe.document import Document

    deciders, pii = _filters(cfg)
    docs = [Document(id=str(i), text="\n".join(fields(item)), source=where) for i, (where, item) in enumerate(records)]
    chain = FilterChain(deciders)
    kept_docs, rejected_docs = chain.run_batch(docs) if deciders else (docs, [])
    sections = [c for c in (cfg.langid, cfg.quality, cfg.safety) if c is not None]
    if sections:  # a filter that raises on many records is broken, as in the curation stages
        check_error_share(chain.funnel(), min(c.max_error_share for c in sections),
                          "curation.{langid,quality,safety}.max_error_share",
                          lambda: next((str(d.metadata["error"]) for d in rejected_docs if "error" in d.metadata), None))
    rejected = [(*records[int(d.id)], d.metadata["reject_reason"]) for d in rejected_docs]
    kept = [records[int(d.id)] for d in sorted(kept_docs, key=lambda d: int(d.id))]
    counts: Counter[str] = Counter()
    if pii is not None:
        redacted = []
        for where, item in kept:
            parts = [Document(id=where, text=t, source=where) for t in fields(item)]
            for p in parts:
                pii.filter(p)
                counts.update(p.metadata.get("pii", {}))
            redacted.append((where, _with_fields(item, [p.text for p in parts])))
        kept = redacted
    return kept, rejected, dict(sorted(counts.items()))


def dedup(records: list[tuple[str, Item]], cfg: PostTrainDedup
          ) -> tuple[list[tuple[str, Item]], list[tuple[str, Item, str]]]:
    """(kept, rejected as duplicate / near_duplicate): the first of each group stays."""
    from llmpipe.curation.dedup.text import exact_hash, normalize

    texts = ["\n".join(fields(item)) for _w, item in records]
    drop: dict[int, str] = {}
    if cfg.exact:
        seen: set[int] = set()
        for i, t in enumerate(texts):
            h = exact_hash(normalize(t))
            if h in seen:
                drop[i] = DUPLICATE
            seen.add(h)
    if cfg.near:
        for i in _near_duplicates(texts, [i for i in range(len(texts)) if i not in drop], cfg):
            drop[i] = NEAR_DUPLICATE
    kept = [r for i, r in enumerate(records) if i not in drop]
    return kept, [(records[i][0], records[i][1], reason) for i, reason in sorted(drop.items())]


def _near_duplicates(texts: Sequence[str], alive: list[int], cfg: PostTrainDedup) -> list[int]:
    """Indexes (of ``alive``) whose shingle Jaccard with an earlier kept record is >= the threshold,
    among pairs that share an LSH band of their MinHash signatures."""
    if len(alive) < 2:
        return []
    from llmpipe.curation.dedup.lsh import band_keys, lsh_params
    from llmpipe.curation.dedup.minhash import signatures
    from llmpipe.curation.dedup.text import shingles

    # numpy below NUMBA_FROM records: numba's first call compiles for ~10 s, longer than numpy takes on them
    sigs = signatures([texts[i] for i in alive], num_perm=cfg.num_perm, seed=cfg.seed, word_ngram=cfg.word_ngram,
                      char_ngram=cfg.word_ngram, backend="auto" if len(alive) >= NUMBA_FROM else "numpy")
    bands, rows = lsh_params(cfg.threshold, cfg.num_perm)
    keys = band_keys(sigs, bands, rows)
    sets = {}
    buckets: dict[tuple[int, int], list[int]] = {}
    out = []
    for j, i in enumerate(alive):
        earlier = {k for b in range(bands) for k in buckets.get((b, int(keys[j, b])), [])}
        if earlier:
            mine = sets.setdefault(i, set(shingles(texts[i], word_ngram=cfg.word_ngram, char_ngram=cfg.word_ngram)))
            if any(_jaccard(mine, sets[k]) >= cfg.threshold for k in sorted(earlier)):
                out.append(i)
                continue
        sets.setdefault(i, set(shingles(texts[i], word_ngram=cfg.word_ngram, char_ngram=cfg.word_ngram)))
        for b in range(bands):
            buckets.setdefault((b, int(keys[j, b])), []).append(i)
    return out


def _jaccard(a: set[bytes], b: set[bytes]) -> float:
    return len(a & b) / max(len(a | b), 1)


def curate(records: list[tuple[str, Item]], bad: list[tuple[str, str]], cfg: PostTrainCuration,
           ngram: int | None) -> tuple[list[tuple[str, Item]], list[dict[str, Any]], dict[str, int]]:
    """(kept records, rejected rows ``{where, reason, ...}``, PII redactions per type): filters, dedup,
    decontamination in that order; ``bad`` rows (``where``, message) are rejected as error:bad_record."""
    kept, rejected, pii = run_filters(records, cfg)
    if cfg.dedup is not None:
        kept, dups = dedup(kept, cfg.dedup)
        rejected += dups
    if ngram is not None:
        from llmpipe.posttrain.decontaminate import Index, builtin_eval_texts, record_text

        index = Index(builtin_eval_texts(), ngram)
        dirty = [index.contaminated(record_text(item)) for _w, item in kept]
        rejected += [(w, item, CONTAMINATED) for (w, item), d in zip(kept, dirty, strict=True) if d]
        kept = [r for r, d in zip(kept, dirty, strict=True) if not d]
    rows = [{"where": w, "reason": BAD_RECORD, "error": msg} for w, msg in bad]
    rows += [{"where": w, "reason": reason, "record": record_json(item)} for w, item, reason in rejected]
    return kept, rows, pii


def record_json(item: Item) -> dict[str, Any]:
    """The record as the readers take it back (prompt as messages)."""
    out: dict[str, Any] = {"prompt": item.messages}
    if isinstance(item, Pair):
        out["response"] = item.response
    else:
        out.update(chosen=item.chosen, rejected=item.rejected)
    return out


def read_kept(artifact: Path, kind: str) -> list[Item]:
    """The records a stage kept, in its order, from its artifact's ``curation/kept.jsonl`` (``kind``:
    ``instructions`` or ``preferences``): how a consumer of the artifact sees what the stage trained on."""
    from llmpipe.posttrain.data import to_pair, to_preference

    path = Path(artifact) / FOLDER / "kept.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no kept records (an artifact of a post-training stage has them)")
    parse = to_pair if kind == "instructions" else to_preference
    return [parse(json.loads(line)["record"], f"{path}:{i}") for i, line in enumerate(_lines(path), 1)]


def write(out: Path, read: int, kept: list[tuple[str, Item]], rejected: list[dict[str, Any]],
          pii: dict[str, int], base: Path | None = None) -> dict[str, Any]:
    """Write ``curation/kept.jsonl`` and ``curation/rejected.jsonl``, then the funnel counted from those
    files (``curation/funnel.json``): ``in == kept + sum(rejected)``, quarantined = the ``error:`` reasons.
    A ``where`` under ``base`` (the config's folder) is written relative to it: one key, one set of bytes,
    wherever the checkout is."""
    from llmpipe.curation.funnel import check_funnel

    d = out / FOLDER
    d.mkdir(parents=True, exist_ok=True)
    prefix = f"{base}/" if base is not None else None

    def rel(text: str) -> str:
        return text.replace(prefix, "") if prefix else text

    _jsonl(d / "kept.jsonl", [{"where": rel(w), "record": record_json(item)} for w, item in kept])
    _jsonl(d / "rejected.jsonl", [{**r, "where": rel(r["where"]), **({"error": rel(r["error"])} if "error" in r else {})}
                                  for r in rejected])
    n_kept = sum(1 for _ in _lines(d / "kept.jsonl"))
    reasons = Counter(json.loads(line)["reason"] for line in _lines(d / "rejected.jsonl"))
    funnel: dict[str, Any] = {"in": n_kept + sum(reasons.values()), "kept": n_kept,
                              "rejected": dict(sorted(reasons.items())),
                              "quarantined": sum(n for r, n in reasons.items() if r.startswith(ERROR_PREFIX))}
    if pii:
        funnel["pii_redactions"] = pii
    check_funnel(funnel, where=str(d))
    if funnel["in"] != read:
        raise RuntimeError(f"{d}: {read} records read, {funnel['in']} written as kept or rejected")
    (d / "funnel.json").write_text(json.dumps(funnel, indent=2, sort_keys=True) + "\n")
    return funnel


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows), encoding="utf-8")


def _lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
