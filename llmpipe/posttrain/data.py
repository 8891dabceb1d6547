"""Instruction and preference data for post-training: readers, the built-in tiny sets, the held-out split.

A source is a JSONL file, a Parquet file, a ``datasets`` ``save_to_disk`` folder (a folder of such
files is read file by file), or one of the built-in sets. Records:

- instructions: ``{"prompt": str, "response": str}`` or ``{"messages": [{"role", "content"}, ...]}``
  whose last message is the assistant's (the response; the messages before it are the prompt);
- preferences: ``{"prompt": str or messages, "chosen": str, "rejected": str}``.

A record that fits neither is an error naming the file, the line (row) and the key. The built-in
sets are written by code, deterministic, in English, German, French and Spanish: short tasks a
model of 64 hidden units can learn in a few dozen steps (write a word in capitals, say it twice,
add two small numbers, name its first letter). In the preference set both answers are correct
and differ only in their closing sentence, a polite one (chosen) or a shorter curt one
(rejected), fixed per language, which the SFT data never shows: DPO has something to learn that SFT did not already teach.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.posttrain.config import BUILTIN_INSTRUCTIONS, BUILTIN_PREFERENCES

Messages = list[dict[str, str]]


class PostTrainDataError(ValueError):
    """A source that cannot be read; the message names the file, the line and the key."""


@dataclass(frozen=True)
class Pair:
    """One instruction pair: the conversation so far (ends with the user's turn) and the answer."""

    prompt: tuple[tuple[str, str], ...]  # (role, content) per message: hashable, so pairs dedup
    response: str

    @property
    def messages(self) -> Messages:
        return [{"role": r, "content": c} for r, c in self.prompt]


@dataclass(frozen=True)
class Preference:
    prompt: tuple[tuple[str, str], ...]
    chosen: str
    rejected: str

    @property
    def messages(self) -> Messages:
        return [{"role": r, "content": c} for r, c in self.prompt]


# -- the built-in sets ------------------------------------------------------------------------------
WORDS = {
    "en": ["apple", "river", "house", "green", "music", "table", "stone", "cloud", "bread", "light",
           "horse", "water", "paper", "night", "garden", "window", "summer", "winter", "forest", "mirror"],
    "de": ["apfel", "fluss", "haus", "grün", "musik", "tisch", "stein", "wolke", "brot", "licht",
           "pferd", "wasser", "papier", "nacht", "garten", "fenster", "sommer", "winter", "wald", "spiegel"],
    "fr": ["pomme", "rivière", "maison", "vert", "musique", "table", "pierre", "nuage", "pain", "lumière",
           "cheval", "eau", "papier", "nuit", "jardin", "fenêtre", "été", "hiver", "forêt", "miroir"],
    "es": ["manzana", "río", "casa", "verde", "música", "mesa", "piedra", "nube", "pan", "luz",
           "caballo", "agua", "papel", "noche", "jardín", "ventana", "verano", "invierno", "bosque", "espejo"],
}
TASKS = {  # language -> task -> prompt template
    "en": {"upper": "Write this word in capitals: {w}", "twice": "Say this word twice: {w}",
           "add": "What is {a} plus {b}?", "first": "What is the first letter of {w}?"},
    "de": {"upper": "Schreibe dieses Wort in Großbuchstaben: {w}", "twice": "Sag dieses Wort zweimal: {w}",
           "add": "Was ist {a} plus {b}?", "first": "Was ist der erste Buchstabe von {w}?"},
    "fr": {"upper": "Écris ce mot en majuscules : {w}", "twice": "Dis ce mot deux fois : {w}",
           "add": "Combien font {a} plus {b} ?", "first": "Quelle est la première lettre de {w} ?"},
    "es": {"upper": "Escribe esta palabra en mayúsculas: {w}", "twice": "Di esta palabra dos veces: {w}",
           "add": "¿Cuánto es {a} más {b}?", "first": "¿Cuál es la primera letra de {w}?"},
}
CLOSINGS = {  # language -> (polite: chosen, curt: rejected); the polite one is a little longer, so a
    # model that has not learned the preference tends to find the curt one more likely (fewer tokens)
    "en": ("Happy to help!", "Go away."),
    "de": ("Gern geschehen!", "Geh weg."),
    "fr": ("Avec plaisir !", "Va-t'en."),
    "es": ("¡Con gusto!", "Vete."),
}


def _task_items() -> list[tuple[str, str, str]]:
    """(language, prompt, answer) for every task and word: 4 languages x 4 tasks x 20 = 320 items."""
    items = []
    for lang, words in WORDS.items():
        t = TASKS[lang]
        for i, w in enumerate(words):
            a, b = i % 7 + 1, (3 * i) % 8 + 1
            items += [(lang, t["upper"].format(w=w), w.upper()), (lang, t["twice"].format(w=w), f"{w} {w}"),
                      (lang, t["add"].format(a=a, b=b), str(a + b)), (lang, t["first"].format(w=w), w[0])]
    return items


def builtin_instructions() -> list[Pair]:
    """The built-in instruction set (320 pairs, see the module docstring)."""
    return [Pair((("user", p),), answer) for _lang, p, answer in _task_items()]


def builtin_preferences() -> list[Preference]:
    """The built-in preference set: the same tasks, chosen closes politely, rejected curtly."""
    out = []
    for lang, p, answer in _task_items():
        polite, curt = CLOSINGS[lang]
        out.append(Preference((("user", p),), f"{answer} {polite}", f"{answer} {curt}"))
    return out


# -- readers ----------------------------------------------------------------------------------------
def _records(source: str, base: Path, bad: list[tuple[str, str]] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) for each record of a file or folder source; ``where`` is ``file:line``. A JSONL
    line that is no JSON object raises, or is appended to ``bad`` as (where, message) when given."""
    path = Path(source) if Path(source).is_absolute() else base / source
    if not path.exists():
        raise PostTrainDataError(f"{source}: no such file or folder")
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()):
        from datasets import load_from_disk

        ds = load_from_disk(str(path))
        return [(f"{path}: row {i + 1}", dict(r)) for i, r in enumerate(ds)]
    files = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".parquet")) if path.is_dir() else [path]
    if not files:
        raise PostTrainDataError(f"{path}: a folder without .jsonl or .parquet files (or a datasets folder)")
    out: list[tuple[str, dict[str, Any]]] = []
    for f in files:
        if f.suffix == ".parquet":
            import pyarrow.parquet as pq

            out += [(f"{f}: row {i + 1}", r) for i, r in enumerate(pq.read_table(f).to_pylist())]
        elif f.suffix == ".jsonl":
            for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    rec = PostTrainDataError(f"{f}:{i}: invalid JSON: {e.msg}")
                if not isinstance(rec, dict | PostTrainDataError):
                    rec = PostTrainDataError(f"{f}:{i}: a record must be a JSON object")
                if isinstance(rec, PostTrainDataError):
                    if bad is None:
                        raise rec
                    bad.append((f"{f}:{i}", str(rec)))
                    continue
                out.append((f"{f}:{i}", rec))
        else:
            raise PostTrainDataError(f"{f}: unknown file type (want .jsonl, .parquet or a datasets folder)")
    return out


def _text(rec: dict[str, Any], key: str, where: str) -> str:
    v = rec.get(key)
    if not isinstance(v, str) or not v.strip():
        raise PostTrainDataError(f"{where}: key {key!r} must be a non-empty string"
                                 + ("" if key in rec else " (missing)"))
    return v


def _messages(value: Any, where: str, key: str) -> tuple[tuple[str, str], ...]:
    if isinstance(value, str):
        return (("user", value),)
    if not isinstance(value, list) or not value:
        raise PostTrainDataError(f"{where}: key {key!r} must be a string or a non-empty list of messages")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise PostTrainDataError(f"{where}: {key}[{j}] must be {{role: system|user|assistant, content: str}}")
        out.append((m["role"], m["content"]))
    return tuple(out)


def to_pair(rec: dict[str, Any], where: str) -> Pair:
    if "messages" in rec:
        msgs = _messages(rec["messages"], where, "messages")
        if len(msgs) < 2 or msgs[-1][0] != "assistant":
            raise PostTrainDataError(f"{where}: key 'messages' must end with the assistant's answer after a prompt")
        return Pair(msgs[:-1], msgs[-1][1])
    if "prompt" not in rec:
        raise PostTrainDataError(f"{where}: an instruction record needs 'prompt' and 'response', or 'messages'")
    return Pair(_messages(rec["prompt"], where, "prompt"), _text(rec, "response", where))


def to_preference(rec: dict[str, Any], where: str) -> Preference:
    if "prompt" not in rec:
        raise PostTrainDataError(f"{where}: a preference record needs 'prompt', 'chosen' and 'rejected'")
    return Preference(_messages(rec["prompt"], where, "prompt"), _text(rec, "chosen", where),
                      _text(rec, "rejected", where))


Located = tuple[str, Any]  # (where: "file:line" or "builtin:...#n", record)


def read_records(sources: list[str], base: Path, kind: str, *, quarantine: bool = False
                 ) -> tuple[list[Located], list[tuple[str, str]]]:
    """(records with where each came from, bad rows as (where, message)) of ``sources``; ``kind`` is
    ``instructions`` or ``preferences``. A bad row (a key missing, a wrong type) raises
    :class:`PostTrainDataError` naming its file and line, or with ``quarantine`` is returned in the
    second list. Nothing is dropped here: repeats go to dedup, which counts them."""
    builtin, make = (BUILTIN_INSTRUCTIONS, to_pair) if kind == "instructions" else (BUILTIN_PREFERENCES, to_preference)
    good: list[Located] = []
    bad: list[tuple[str, str]] = []
    for s in sources:
        if s == builtin:
            items = builtin_instructions() if kind == "instructions" else builtin_preferences()
            good += [(f"{s}#{i + 1}", x) for i, x in enumerate(items)]
            continue
        for where, rec in _records(s, base, bad if quarantine else None):
            try:
                good.append((where, make(rec, where)))
            except PostTrainDataError as e:
                if not quarantine:
                    raise
                bad.append((where, str(e)))
    return good, bad


def load_pairs(sources: list[str], base: Path) -> list[Pair]:
    """Every instruction pair of ``sources``, in order, exact repeats dropped (bad rows raise)."""
    return list(dict.fromkeys(x for _w, x in read_records(sources, base, "instructions")[0]))


def load_preferences(sources: list[str], base: Path) -> list[Preference]:
    """Every preference record of ``sources``, in order, exact repeats dropped (bad rows raise)."""
    return list(dict.fromkeys(x for _w, x in read_records(sources, base, "preferences")[0]))


def sources_key(sources: list[str], base: Path) -> str:
    """A content hash of the sources (files' bytes, the built-in sets' records): a stage's key moves
    when its data does, not only when its paths do."""
    h = hashlib.sha256()
    for s in sources:
        h.update(s.encode() + b"\0")
        if s in (BUILTIN_INSTRUCTIONS, BUILTIN_PREFERENCES):
            items = builtin_instructions() if s == BUILTIN_INSTRUCTIONS else builtin_preferences()
            h.update(json.dumps([x.__dict__ for x in items], ensure_ascii=False).encode())
            continue
        path = Path(s) if Path(s).is_absolute() else base / s
        if not path.exists():
            raise PostTrainDataError(f"{s}: no such file or folder")
        for f in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
            h.update(f.relative_to(path).as_posix().encode() if path.is_dir() else b"")
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def is_held_out(prompt: tuple[tuple[str, str], ...], fraction: float) -> bool:
    """Whether a prompt is in the held-out part: a hash of its text, so the split never moves."""
    h = hashlib.sha1(json.dumps(prompt, ensure_ascii=False).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def split(items: list[Any], fraction: float) -> tuple[list[Any], list[Any]]:
    """(train, held out) by :func:`is_held_out` on each item's prompt; neither may be empty."""
    held = [x for x in items if is_held_out(x.prompt, fraction)]
    train = [x for x in items if not is_held_out(x.prompt, fraction)]
    if not held or not train:
        raise PostTrainDataError(f"held_out: {fraction} of {len(items)} records leaves an empty "
                                 f"{'held-out' if not held else 'training'} part")
    return train, held
