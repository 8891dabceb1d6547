"""Coherence: perplexity under a reference LM ranks natural text above corrupted copies of it.

Both scorers run through the real stage on en, de and zh documents of a small grammar (held out
from what the reference model saw) and corrupted copies of some of them (words shuffled, random
letters, a repeated navigation bar): at least 95% of the copies land in CCNet's tail bucket, the
funnel adds up, and rejected documents keep their reason and scores.
"""

from __future__ import annotations

import importlib.util
import math
import random
import time
from pathlib import Path

import pytest

from llmpipe.curation.arpa import kneser_ney, write_arpa
from llmpipe.curation.dimensions_config import CoherenceConfig
from llmpipe.document import read_shard, rejected_paths, shard_paths
from llmpipe.store import ArtifactStore
from tests.fixtures.quality_corpus import labelled_corpus, run_stage, train_tiny_lm, write_reference

LANGS = ("en", "de", "zh")
# kenlm has no wheel: pip builds it from source (a C++ compiler; pip fetches CMake). `make install`
# installs it with the [coherence] extra; a venv without it skips only the KenLM scorer's tests.
needs_kenlm = pytest.mark.skipif(importlib.util.find_spec("kenlm") is None,
                                 reason="kenlm is not installed (pip install 'llmpipe[coherence]' builds it from "
                                        "source with a C++ compiler)")


def _corpus() -> list:
    # 40 natural documents and 20 copies (7 of each corruption) per language: a third of the run is
    # corrupted, so the tail (over the 60th percentile, CCNet's cut) has room for every copy
    return [d for lang in LANGS for d in labelled_corpus(lang, 42, 7)]


def _check(stats: dict, out: Path, metric: str) -> None:
    docs = [d for p in shard_paths(out) for d in read_shard(p)]
    rejected = [d for p in rejected_paths(out) for d in read_shard(p)]
    assert stats["docs_in"] == len(docs) + len(rejected) == stats["docs_kept"] + sum(stats["rejected"].values())
    every = docs + rejected
    for lang in LANGS:
        bad = [d for d in every if d.metadata["lang"] == lang and d.metadata["kind"] != "natural"]
        tail = [d for d in bad if d.metadata["scores"]["coherence"]["bucket"] == "tail"]
        assert len(bad) == 21 and len(tail) >= 0.95 * len(bad), (lang, [d.metadata["kind"] for d in bad
                                                                         if d not in tail])
        assert all(d.metadata["scores"]["coherence"][metric] > 0 for d in every if d.metadata["lang"] == lang)
    for d in rejected:  # reason, stage and the scores the decision came from
        assert d.metadata["reject_reason"] == "coherence_tail" and d.metadata["rejected_by"] == "coherence"
        assert d.metadata["scores"]["coherence"]["bucket"] == "tail"
    assert all(d.metadata["scores"]["coherence"]["bucket"] in ("head", "middle") for d in docs)


@needs_kenlm
def test_kenlm_reference_models_put_corrupted_copies_in_the_tail(tmp_path: Path) -> None:
    refs = {lang: [str(write_reference(tmp_path / "ref" / f"{lang}.txt", lang))] for lang in LANGS}
    cfg = CoherenceConfig(enabled=True, scorer="kenlm", reference=refs, order=3)
    stats, out = run_stage("coherence", cfg, _corpus(), tmp_path)
    _check(stats, out, "perplexity")
    assert sorted(p.name for p in (out / "models").iterdir()) == ["de.arpa", "en.arpa", "zh.arpa"]
    # the same model by path scores the same
    cfg2 = CoherenceConfig(enabled=True, kenlm_models={lang: str(out / "models" / f"{lang}.arpa") for lang in LANGS})
    stats2, out2 = run_stage("coherence", cfg2, _corpus(), tmp_path / "again")
    assert stats2["rejected"] == stats["rejected"]


def test_without_the_kenlm_package_arpa_models_score_in_python(tmp_path: Path, monkeypatch) -> None:
    """The same ranking where ``kenlm`` is not installed (``import kenlm`` fails): ARPA text models
    score through ``ArpaModel``; a binary model asks for the extra."""
    import sys

    from llmpipe.curation import coherence

    monkeypatch.setitem(sys.modules, "kenlm", None)  # what an install without [coherence] sees
    coherence.load_kenlm.cache_clear()
    refs = {lang: [str(write_reference(tmp_path / "ref" / f"{lang}.txt", lang))] for lang in LANGS}
    stats, out = run_stage("coherence", CoherenceConfig(enabled=True, scorer="kenlm", reference=refs, order=3),
                           _corpus(), tmp_path)
    _check(stats, out, "perplexity")
    (tmp_path / "model.bin").write_bytes(b"mmap lm http://kheafield.com/code format version 5\0")
    with pytest.raises(ImportError, match=r"KenLM binary model, which needs the kenlm package: pip install"):
        coherence.load_kenlm(str(tmp_path / "model.bin"))
    coherence.load_kenlm.cache_clear()


@needs_kenlm
def test_a_pinned_python_scorer_gives_one_key_and_one_score_on_every_install(tmp_path: Path, monkeypatch) -> None:
    """``arpa_scorer: python`` reads the ARPA model in Python where kenlm is installed too: the tiny
    configs' keys (which ``make run`` publishes without kenlm and ``make test`` plans with it) and the
    scores are those of an install without kenlm; ``kenlm`` pinned where it is missing is refused."""
    import sys

    from llmpipe.config import load_config
    from llmpipe.curation import coherence
    from llmpipe.curation.arpa import ArpaModel
    from llmpipe.dag import plan
    from tests.conftest import ROOT

    refs = {"en": [str(write_reference(tmp_path / "ref" / "en.txt", "en"))]}
    cfg = CoherenceConfig(enabled=True, reference=refs, arpa_scorer="python")
    configs = [ROOT / "configs" / name for name in ("tiny.yaml", "tiny-chat.yaml")]
    with_kenlm = [{n: p.key for n, p in plan(load_config(c)).items()} for c in configs]
    stats, out = run_stage("coherence", cfg, _corpus(), tmp_path / "with")
    assert isinstance(coherence.load_kenlm(str(out / "models" / "en.arpa"), "python"), ArpaModel)
    monkeypatch.setitem(sys.modules, "kenlm", None)  # what an install without [coherence] sees
    coherence.load_kenlm.cache_clear()
    assert [{n: p.key for n, p in plan(load_config(c)).items()} for c in configs] == with_kenlm
    auto = CoherenceConfig(enabled=True, reference=refs)
    assert auto.key_dict() == cfg.key_dict()
    stats2, out2 = run_stage("coherence", auto, _corpus(), tmp_path / "without")
    scores = [[d.metadata["scores"] for d in read_shard(p)] for p in shard_paths(out)]
    assert scores == [[d.metadata["scores"] for d in read_shard(p)] for p in shard_paths(out2)]
    assert stats2["rejected"] == stats["rejected"]
    with pytest.raises(ValueError, match=r"arpa_scorer 'kenlm' needs the kenlm package"):
        CoherenceConfig(enabled=True, reference=refs, arpa_scorer="kenlm")
    coherence.load_kenlm.cache_clear()


def test_own_model_scorer_puts_corrupted_copies_in_the_tail(tmp_path: Path) -> None:
    """Our own model, named as a pretrain artifact of the store (the loop data -> model -> data) or by path."""
    ckpt = train_tiny_lm(tmp_path / "lm")
    key = "ab" * 32
    ArtifactStore(tmp_path / "store").publish("pretrain", key, ckpt, version="test", config={}, inputs={},
                                              stats={}, started=time.time())
    cfg = CoherenceConfig(enabled=True, scorer="model", model=f"store:pretrain/{key[:12]}")
    stats, out = run_stage("coherence", cfg, _corpus(), tmp_path)
    _check(stats, out, "bits_per_byte")
    by_path = CoherenceConfig(enabled=True, scorer="model", model=str(tmp_path / "store" / "pretrain" / key))
    assert run_stage("coherence", by_path, _corpus(), tmp_path / "by-path")[0]["rejected"] == stats["rejected"]
    with pytest.raises(FileNotFoundError, match="store:pretrain/ffff: no such artifact"):
        run_stage("coherence", CoherenceConfig(enabled=True, scorer="model", model="store:pretrain/ffff"),
                  _corpus()[:3], tmp_path / "missing")


def test_threshold_rule_and_unscored_policy(tmp_path: Path) -> None:
    """Absolute per-language limits decide from the stored score; a language with no model is unscored."""
    pytest.importorskip("kenlm", reason="kenlm is not installed (pip install 'llmpipe[coherence]')")
    ref = str(write_reference(tmp_path / "en.txt", "en"))
    docs = labelled_corpus("en", 10, 3) + labelled_corpus("de", 2, 0)
    cfg = CoherenceConfig(enabled=True, reference={"en": [ref]}, rule="threshold", max_score={"en": 50.0},
                          unscored="drop")
    stats, out = run_stage("coherence", cfg, docs, tmp_path)
    assert stats["rejected"] == {"low_coherence": 9, "coherence_unscored": 2}
    kept = [d for p in shard_paths(out) for d in read_shard(p)]
    assert {d.metadata["kind"] for d in kept} == {"natural"}
    assert all(d.metadata["scores"]["coherence"]["perplexity"] <= 50 for d in kept)


def test_arpa_is_deterministic_and_normalized(tmp_path: Path) -> None:
    """Same sentences, same bytes; every conditional distribution of the model sums to one."""
    rng = random.Random(0)
    sents = [[rng.choice("abcdefg") for _ in range(rng.randint(1, 8))] for _ in range(200)]
    a, b = write_arpa(sents, tmp_path / "a.arpa", 3), write_arpa(list(reversed(sents)), tmp_path / "b.arpa", 3)
    assert a.read_bytes() == b.read_bytes()
    prob, backoff = kneser_ney(sents, 3)

    def p(w: str, h: tuple[str, ...]) -> float:  # ARPA's backoff rule, as KenLM applies it
        if (*h, w) in prob[len(h) + 1]:
            return prob[len(h) + 1][(*h, w)]
        if not h:
            return prob[1][("<unk>",)]
        return backoff[len(h)].get(h, 1.0) * p(w, h[1:])

    vocab = [*"abcdefg", "</s>", "<unk>"]
    for h in [(), ("<s>",), ("a",), ("a", "b"), ("g", "g"), ("<s>", "c")]:
        assert math.isclose(sum(p(w, h) for w in vocab), 1.0, rel_tol=1e-9), h


@needs_kenlm
def test_kenlm_reads_the_arpa_as_written(tmp_path: Path) -> None:
    """KenLM's own scores of the written ARPA match the model's probabilities (and sum to one)."""
    import kenlm

    rng = random.Random(1)
    sents = [[rng.choice("abcde") for _ in range(rng.randint(1, 6))] for _ in range(100)]
    m = kenlm.Model(str(write_arpa(sents, tmp_path / "m.arpa", 3)))
    for ctx in (["a"], ["a", "b"], []):
        base = m.score(" ".join(ctx), bos=True, eos=False)
        total = sum(10 ** (m.score(" ".join([*ctx, w]), bos=True, eos=False) - base) for w in [*"abcde", "zz"])
        total += 10 ** (m.score(" ".join(ctx), bos=True, eos=True) - base)  # </s>
        assert math.isclose(total, 1.0, rel_tol=1e-5), ctx


@needs_kenlm
def test_the_python_arpa_scorer_gives_kenlms_scores(tmp_path: Path) -> None:
    """Pins ArpaModel (the scorer without the compiled package) to KenLM's own query, OOV words included."""
    import kenlm

    from llmpipe.curation.arpa import ArpaModel

    rng = random.Random(2)
    sents = [[rng.choice("abcdefg") for _ in range(rng.randint(1, 8))] for _ in range(300)]
    path = str(write_arpa(sents, tmp_path / "m.arpa", 3))
    ours, theirs = ArpaModel(path), kenlm.Model(path)
    probes = [" ".join(rng.choice("abcdefgxy") for _ in range(rng.randint(1, 10))) for _ in range(200)]
    for text in probes:
        for bos, eos in ((True, True), (True, False), (False, True)):
            assert math.isclose(ours.score(text, bos, eos), theirs.score(text, bos=bos, eos=eos), abs_tol=2e-4), text


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="needs kenlm_models or reference"):
        CoherenceConfig(enabled=True)
    with pytest.raises(ValueError, match="needs `model`"):
        CoherenceConfig(enabled=True, scorer="model")
    with pytest.raises(ValueError, match="two percentiles"):
        CoherenceConfig(buckets=[70, 30])


@needs_kenlm
def test_a_rule_is_re_applied_from_the_stored_scores(tmp_path: Path) -> None:
    """The scores kept on every document (kept and rejected) decide a new rule exactly as a rerun does."""
    from llmpipe.curation.coherence import decide

    ref = {"en": [str(write_reference(tmp_path / "en.txt", "en"))]}
    docs = labelled_corpus("en", 30, 5)
    _, out = run_stage("coherence", CoherenceConfig(enabled=True, reference=ref), docs, tmp_path / "a", shards=1)
    stored = [d for p in [*shard_paths(out), *rejected_paths(out)] for d in read_shard(p)]
    stored.sort(key=lambda d: [x.id for x in docs].index(d.id))
    strict = CoherenceConfig(enabled=True, reference=ref, buckets=[20, 40], default_keep=["head"])
    rule, _ = decide([[d.metadata["scores"]["coherence"] for d in stored]], "perplexity", strict)
    stats, out2 = run_stage("coherence", strict, docs, tmp_path / "b", shards=1)
    rerun = {d.id: d.metadata.get("reject_reason") for p in [*shard_paths(out2), *rejected_paths(out2)]
             for d in read_shard(p)}
    assert {d.id: rule(d.metadata["scores"]["coherence"]).reason for d in stored} == rerun
    assert stats["rejected"] == {"coherence_middle": 9, "coherence_tail": 27}  # 45 docs: 9 head, 9 middle


@pytest.mark.parametrize("order", [1, 2, 3, 4, 5])
def test_the_indexed_arpa_scorer_adds_the_same_floats_as_the_per_word_definition(tmp_path: Path, order: int) -> None:
    """The vector scorer (ids in sorted arrays, a batch of sentences at once) against
    ``reference_score`` (a dict lookup per word and context length): equal floats, not close ones,
    with unknown words, the markers written as words, empty sentences and every bos/eos choice."""
    from llmpipe.curation.arpa import ArpaModel

    rng = random.Random(order)
    sents = [[rng.choice("abcdefg") for _ in range(rng.randint(1, 9))] for _ in range(400)]
    model = ArpaModel(write_arpa(sents, tmp_path / "m.arpa", order))
    vocab = [*"abcdefgxy", "<s>", "</s>", "<unk>"]
    probes = [" ".join(rng.choice(vocab) for _ in range(rng.randint(0, 12))) for _ in range(1000)]
    for bos, eos in ((True, True), (True, False), (False, True), (False, False)):
        want = [model.reference_score(p, bos, eos) for p in probes]
        assert model.score_lines(probes, bos, eos) == want
        assert [model.score(p, bos, eos) for p in probes[:20]] == want[:20]
    assert model.score_lines([]) == []


def test_a_batch_of_documents_gets_each_documents_own_perplexity(tmp_path: Path) -> None:
    """kenlm_perplexities over a batch equals kenlm_perplexity one document at a time, and that
    equals the per-sentence sum through the per-word definition (documents without words: None)."""
    from llmpipe.curation import coherence
    from llmpipe.curation.arpa import ArpaModel

    rng = random.Random(5)
    words = "the cat sat on a mat while dog ran far away 12 times".split()
    refs = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + "." for _ in range(200)]
    model = ArpaModel(coherence.build_reference_model(refs, "en", tmp_path / "en.arpa", 3))
    docs = ["\n".join(" ".join(rng.choice([*words, "zebra"]) for _ in range(rng.randint(1, 9))) + "."
                      for _ in range(rng.randint(1, 4))) for _ in range(60)] + ["", "...", "   \n"]
    batch = coherence.kenlm_perplexities(model, docs, "en")
    assert batch == [coherence.kenlm_perplexity(model, d, "en") for d in docs]
    for doc, (ppl, n) in zip(docs, batch, strict=True):
        sents = [t for s in coherence.sentences_of(doc) if (t := coherence.tokenize(coherence.normalize(s), "en"))]
        log10 = 0.0
        for t in sents:
            log10 += model.reference_score(" ".join(t))
        assert (ppl, n) == ((10.0 ** (-log10 / n), n) if sents else (None, 0))
