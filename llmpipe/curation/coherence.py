"""Coherence: how fluent a document reads, as its perplexity under a reference language model.

Two scorers, one per-document score where higher means less fluent:

* ``kenlm`` (CCNet / RedPajama / Dolma): an n-gram model per language, by path (``.arpa`` or a
  KenLM binary) or estimated in the stage from a reference set (:mod:`llmpipe.curation.arpa`; the
  ARPA files are part of the artifact). Text is normalized as CCNet does (lowercase, digits to 0),
  split into words (CJK runs segmented, :func:`llmpipe.curation.text.words_of`) or into
  SentencePiece pieces when a language names a SentencePiece model (as CCNet's models expect); each
  line is scored as a sentence and the document's perplexity is ``10 ** (-sum log10 p / tokens)``,
  ``</s>`` counted as a token. Score: ``perplexity``.
* ``model``: a causal LM of our own (a pretrain or quantize artifact of this store, named
  ``store:<stage>/<key>``, or any ``save_pretrained`` checkpoint folder), scored with the evaluation
  code (:func:`llmpipe.evaluation.metrics.score_batch`): the document's bits per byte, which does
  not depend on the tokenizer. Score: ``bits_per_byte``. This closes the loop data -> model -> data.

The decide step applies an absolute ``max_score`` per language, or CCNet's buckets: per language,
the documents at or under the ``buckets[0]`` percentile of the run's scores are ``head``, those over
``buckets[1]`` are ``tail``, the rest ``middle``; ``keep`` names the buckets kept per language.
"""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Iterable, Sequence
from functools import lru_cache
from itertools import islice
from pathlib import Path
from typing import Any

from llmpipe.curation.arpa import write_arpa
from llmpipe.curation.scored import Decision
from llmpipe.document import iter_documents, iter_rows
from llmpipe.lazy import lazy_import

np = lazy_import("numpy")
_DIGIT = re.compile(r"\d")
_SENTENCE_END = re.compile(r"(?<=[.!?。！？])\s+")


def normalize(text: str) -> str:
    """CCNet's normalization before its KenLM models: lowercase, every digit a 0."""
    return _DIGIT.sub("0", text.lower())


def tokenize(line: str, lang: str, sp_model: str | None = None) -> list[str]:
    """The tokens a KenLM model of ``lang`` sees for one normalized line."""
    if sp_model:
        return list(_sentencepiece(sp_model).encode(line, out_type=str))
    from llmpipe.curation.text import words_of

    return [w for w in words_of(line, lang) if not w.isspace()]


@lru_cache(maxsize=8)
def _sentencepiece(path: str) -> Any:
    import sentencepiece

    if not Path(path).is_file():
        raise FileNotFoundError(f"coherence.sentencepiece: no model file at {path}")
    return sentencepiece.SentencePieceProcessor(model_file=path)


def sentences_of(text: str) -> list[str]:
    """Lines, and sentences inside long lines: the units a KenLM model was trained on."""
    out = []
    for line in text.splitlines():
        out.extend(s for s in _SENTENCE_END.split(line.strip()) if s.strip())
    return out


def build_reference_model(texts: Sequence[str], lang: str, path: Path, order: int,
                          sp_model: str | None = None) -> Path:
    """Estimate the ARPA model of ``lang`` from reference documents (the stage's in-artifact model)."""
    sents = [tokenize(normalize(s), lang, sp_model) for t in texts for s in sentences_of(t)]
    sents = [s for s in sents if s]
    if not sents:
        raise ValueError(f"coherence.reference.{lang}: the reference documents hold no words")
    return write_arpa(sents, path, order=order)


@lru_cache(maxsize=16)
def load_kenlm(path: str, scorer: str = "auto") -> Any:
    """A ``kenlm.Model``, or with ``scorer`` python (or auto without the package) the Python reader of
    an ARPA text model (cached per process: each shard worker loads a model once)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"coherence.kenlm_models: no model file at {path}")
    kenlm = None
    if scorer != "python":  # the compiled package is an extra; ARPA text models score in Python too
        try:
            import kenlm
        except ImportError:
            kenlm = None
    if kenlm is not None:
        config = kenlm.Config()
        config.show_progress = False  # its progress bar goes to stderr, in every shard worker
        return kenlm.Model(path, config)
    if Path(path).read_bytes()[:64].lstrip().startswith(b"\\data\\"):
        from llmpipe.curation.arpa import ArpaModel

        return ArpaModel(path)
    why = "coherence.arpa_scorer python reads ARPA text only" if scorer == "python" else "needs the kenlm package"
    raise ImportError(f"coherence.kenlm_models: {path} is a KenLM binary model, which {why}: pip install "
                      f"'llmpipe[coherence]' (builds it with a C++ compiler)")


def kenlm_perplexity(model: Any, text: str, lang: str, sp_model: str | None = None) -> tuple[float | None, int]:
    """(perplexity, tokens scored incl. one </s> per sentence); (None, 0) for a text with no words."""
    return kenlm_perplexities(model, [text], lang, sp_model)[0]


def kenlm_perplexities(model: Any, texts: Sequence[str], lang: str, sp_model: str | None = None
                       ) -> list[tuple[float | None, int]]:
    """:func:`kenlm_perplexity` of each text. The Python ARPA scorer takes every sentence of the
    texts in one call (``score_lines``: a vector pass per n-gram order instead of a tuple of strings
    built and looked up per word and context length); each text's sum over its sentences is the same
    left-to-right one either way, so the perplexities are the same floats."""
    sents = [[toks for sent in sentences_of(text) if (toks := tokenize(normalize(sent), lang, sp_model))]
             for text in texts]
    lines = [" ".join(toks) for doc in sents for toks in doc]
    batch = getattr(model, "score_lines", None)
    scores = iter(batch(lines) if batch is not None else [model.score(line, bos=True, eos=True) for line in lines])
    out: list[tuple[float | None, int]] = []
    for doc in sents:
        log10, n = 0.0, 0
        for toks in doc:
            log10 += next(scores)
            n += len(toks) + 1
        out.append((10.0 ** (-log10 / n), n) if n else (None, 0))
    return out


BATCH = 256  # documents whose sentences the Python ARPA scorer takes in one call


def score_kenlm_shard(shard: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Per document: ``{"lang", "perplexity", "tokens"}`` (perplexity None: no model or no words)."""
    models, sp, default_lang = payload["models"], payload["sentencepiece"], payload["default_lang"]
    scorer = payload.get("arpa_scorer", "auto")
    rows = iter_rows(shard, ("text", "metadata"))  # no Document per row: the model's work only
    out: list[dict[str, Any]] = []
    while chunk := [(text, _lang(meta, default_lang)) for text, meta in islice(rows, BATCH)]:
        results: list[tuple[float | None, int]] = [(None, 0)] * len(chunk)
        for lang in dict.fromkeys(lang for _, lang in chunk):  # each language's documents with its model
            path = models.get(lang)
            if path is None:
                continue
            at = [i for i, (_, la) in enumerate(chunk) if la == lang]
            scored = kenlm_perplexities(load_kenlm(path, scorer), [chunk[i][0] for i in at], lang, sp.get(lang))
            for i, r in zip(at, scored, strict=True):
                results[i] = r
        out.extend({"lang": lang, "perplexity": None if ppl is None else round(ppl, 4), "tokens": n}
                   for (_, lang), (ppl, n) in zip(chunk, results, strict=True))
    return out


# -- our own model ------------------------------------------------------------------------------------
@lru_cache(maxsize=2)
def _own_model(ckpt: str, device: str) -> tuple[Any, Any, Any]:
    from llmpipe.evaluation.metrics import token_byte_lengths
    from llmpipe.evaluation.model_io import load_model, load_tokenizer, resolve_device

    tok = load_tokenizer(Path(ckpt))
    model = load_model(Path(ckpt), resolve_device(device))
    byte_len = token_byte_lengths(tok)
    vocab = model.get_output_embeddings().weight.shape[0]
    if len(byte_len) < vocab:
        byte_len = np.concatenate([byte_len, np.zeros(vocab - len(byte_len), dtype=np.int64)])
    return model, tok, byte_len


def model_bits_per_byte(ckpt: str, texts: Sequence[str], device: str = "cpu", max_tokens: int = 1024,
                        batch_size: int = 8) -> list[tuple[float | None, int]]:
    """(bits per byte, bytes scored) per text under a causal LM checkpoint, via the evaluation code.

    Each text starts after the model's BOS (or end-of-text) token, so its first token is scored too;
    texts longer than ``max_tokens`` tokens (or than the model has positions) are scored on their first ones.
    """
    import torch

    from llmpipe.evaluation.metrics import LN2, score_batch

    model, tok, byte_len = _own_model(ckpt, device)
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    positions = getattr(model.config, "max_position_embeddings", None)
    limit = min(max_tokens, positions - 1) if positions else max_tokens  # the start token takes a position
    seqs = [np.asarray([start, *tok(t, add_special_tokens=False).input_ids[:limit]], dtype=np.int64)
            for t in texts]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths batch together
    out: list[tuple[float | None, int]] = [(None, 0)] * len(seqs)
    # one thread: float sums do not depend on the machine's core count (same key, same bytes), and
    # the shard workers are the parallelism
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            cols = score_batch(model, [seqs[j] for j in idx], tok.pad_token_id, byte_len)
            for j, c in zip(idx, cols, strict=True):
                sel = c["scored"]
                nbytes = int(c["bytes"][sel].sum())
                out[j] = (float(c["nll"][sel].sum()) / (LN2 * nbytes), nbytes) if nbytes else (None, 0)
    finally:
        torch.set_num_threads(threads)
    return out


def score_model_shard(shard: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Per document: ``{"lang", "bits_per_byte", "bytes"}`` under our own model."""
    docs = list(iter_documents(shard))
    scores = model_bits_per_byte(payload["checkpoint"], [d.text for d in docs], payload["device"],
                                 payload["max_tokens"], payload["batch_size"])
    return [{"lang": _lang(d.metadata, payload["default_lang"]),
             "bits_per_byte": None if b is None else round(b, 6), "bytes": n}
            for d, (b, n) in zip(docs, scores, strict=True)]


def _lang(meta: dict[str, Any], default: str) -> str:
    lang = meta.get("lang")
    return lang if isinstance(lang, str) and lang else default


# -- decide ---------------------------------------------------------------------------------------------
def decide(scores: Iterable[list[dict[str, Any]]], metric: str, cfg: Any
           ) -> tuple[BucketRule, dict[str, tuple[float, float]]]:
    """The rule and the two cuts per language (the scores at the ``buckets`` percentiles of this run),
    from the stored scores only (re-appliable without the model).

    ``scores``: per shard, read once; only each language's values are held (8 bytes a document).
    """
    by_lang: dict[str, array[float]] = {}
    for shard in scores:
        for s in shard:
            if s[metric] is not None:
                by_lang.setdefault(s["lang"], array("d")).append(s[metric])
    cuts = {lang: tuple(float(x) for x in np.percentile(np.frombuffer(v, dtype=np.float64), cfg.buckets))
            for lang, v in by_lang.items()}
    return BucketRule(metric, cfg, cuts), cuts


def bucket_of(value: float, cuts: tuple[float, float]) -> str:
    """CCNet's bucket: head at or under the first cut, tail over the second, middle between."""
    return "head" if value <= cuts[0] else "tail" if value > cuts[1] else "middle"


class BucketRule:
    """A document's scores -> its :class:`Decision` (bucket and reject reason): picklable, so the
    write step applies it in the shard workers.

    A handful of outcomes (bucket x reason) covers every document: each is one shared, read-only
    :class:`Decision` per process, not three objects per document.
    """

    def __init__(self, metric: str, cfg: Any, cuts: dict[str, tuple[float, float]]) -> None:
        self.metric, self.cfg, self.cuts = metric, cfg, cuts
        self.outcomes: dict[tuple[str | None, str | None], Decision] = {}

    def __call__(self, s: dict[str, Any]) -> Decision:
        key = self.outcome(s[self.metric], s["lang"])
        d = self.outcomes.get(key)
        if d is None:
            d = self.outcomes[key] = Decision(key[0], scores={"bucket": key[1]})
        return d

    def outcome(self, value: Any, lang: str) -> tuple[str | None, str | None]:
        """(reject reason or None, bucket or None) for one document."""
        cfg = self.cfg
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return (None if cfg.unscored == "keep" else "coherence_unscored"), None
        bucket = bucket_of(value, self.cuts[lang])
        if cfg.rule == "threshold":
            limit = cfg.max_score.get(lang, cfg.default_max_score)
            return (None if limit is None or value <= limit else "low_coherence"), bucket
        keep = cfg.keep.get(lang, cfg.default_keep)
        return (None if bucket in keep else f"coherence_{bucket}"), bucket
