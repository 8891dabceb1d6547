"""Model metrics: perplexity, bits-per-byte, next-token accuracy, greedy samples; task files checked.

Everything the evaluate stage reports and the quantize gate compares comes from
:func:`evaluate_model`, so the fp model and its quantized copy are measured by exactly one code path.

Definitions (all sums in float64 over *scored* targets: every position whose next token is not
padding; end-of-text targets are scored too, they are part of what the model must predict):

- ``loss`` = mean negative log-likelihood in nats per token; ``perplexity = exp(loss)``.
- ``bits_per_byte`` = total NLL / (ln 2 * UTF-8 bytes those target tokens spell). Special tokens
  spell 0 bytes. Unlike perplexity it does not depend on the tokenizer, so models with different
  vocabularies (or the same model before and after a tokenizer change) compare fairly.
- ``accuracy`` = share of targets where the arg-max of the logits equals the target token.

Timings (scoring seconds, generation seconds and tokens/s) come back apart, under ``timings``: they
measure one run, so the stages put them in the manifest's stats, never in ``results.json``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from llmpipe.files import jsonl_values

LN2 = math.log(2.0)


@dataclass
class EvalSequence:
    """One held-out token sequence and the language of what it holds.

    ``lang`` is a name for the whole sequence, or an int array with one entry per *target*
    (``len(tokens) - 1``) indexing ``language_names`` of :func:`evaluate_model` -- the layout of the
    tokenize artifact's ``.lang.npy`` files, where packed sequences mix documents of several languages.
    Targets whose index is out of range (255 = padding) count overall only.
    """

    tokens: Sequence[int] | np.ndarray
    lang: str | np.ndarray | None = None
    entity: np.ndarray | None = None  # per target: 1 where it overlaps an entity span (tokenize.entity_mask)


@dataclass
class Tally:
    """Sums over scored targets; metrics are derived so that tallies add across batches and languages."""

    nll: float = 0.0
    tokens: int = 0
    correct: int = 0
    bytes: int = 0
    sequences: int = 0

    def add(self, other: Tally) -> None:
        self.nll += other.nll
        self.tokens += other.tokens
        self.correct += other.correct
        self.bytes += other.bytes
        self.sequences += other.sequences

    def metrics(self) -> dict[str, Any]:
        loss = self.nll / self.tokens if self.tokens else float("nan")
        return {
            "sequences": self.sequences, "tokens": self.tokens, "bytes": self.bytes,
            "nll_nats": self.nll, "loss": loss,
            "perplexity": math.exp(loss) if self.tokens else float("nan"),
            "bits_per_byte": self.nll / (LN2 * self.bytes) if self.bytes else float("nan"),
            "accuracy": self.correct / self.tokens if self.tokens else float("nan"),
        }


# -- bytes per token ----------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_byte_lengths(tokenizer: Any) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens), indexed by id.

    Byte-level BPE tokens are read through the byte table, which is exact even for tokens that hold
    part of a multi-byte character (decoding those alone would give U+FFFD, 3 bytes).
    """
    n = len(tokenizer)
    toks = tokenizer.convert_ids_to_tokens(list(range(n)))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = type(decoder).__name__ == "ByteLevel"
    table = _byte_decoder()
    out = np.zeros(n, dtype=np.int64)
    for i, t in enumerate(toks):
        if i in special or t is None:
            continue
        if byte_level and all(c in table for c in t):
            out[i] = len(t)
        else:
            out[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return out


# -- perplexity / bpb / accuracy -----------------------------------------------------------------------
def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def score_batch(model: torch.nn.Module, batch: list[np.ndarray], pad_id: int | None,
                byte_len: np.ndarray) -> list[dict[str, np.ndarray]]:
    """Per-target arrays (nll, correct, bytes, scored) of each sequence of one right-padded batch."""
    dev = model_device(model)
    width = max(len(s) for s in batch)
    ids = torch.full((len(batch), width), pad_id if pad_id is not None else 0, dtype=torch.long)
    valid = torch.zeros((len(batch), width), dtype=torch.bool)
    for r, s in enumerate(batch):
        t = torch.as_tensor(np.asarray(s, dtype=np.int64))
        ids[r, : len(t)] = t
        valid[r, : len(t)] = True if pad_id is None else t != pad_id
    ids, valid = ids.to(dev), valid.to(dev)
    logits = model(input_ids=ids, attention_mask=valid.long()).logits[:, :-1].float()
    target, mask = ids[:, 1:], valid[:, 1:] & valid[:, :-1]
    nll = -F.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    cols = {"nll": nll.double(), "correct": logits.argmax(-1) == target,
            "bytes": torch.as_tensor(byte_len, device=dev)[target], "scored": mask}
    cols = {k: v.cpu().numpy() for k, v in cols.items()}
    return [{k: v[r, : len(s) - 1] for k, v in cols.items()} for r, s in enumerate(batch)]


def _tally(cols: dict[str, np.ndarray], sel: np.ndarray) -> Tally:
    return Tally(nll=float(cols["nll"][sel].sum()), tokens=int(sel.sum()), correct=int(cols["correct"][sel].sum()),
                 bytes=int(cols["bytes"][sel].sum()), sequences=int(sel.any()))


#: per-target columns (nll, correct, bytes, scored) of each sequence of one batch of token arrays
Scorer = Callable[[list[np.ndarray]], list[dict[str, np.ndarray]]]


def language_model_metrics(model: torch.nn.Module, sequences: Sequence[EvalSequence], pad_id: int | None,
                           byte_len: np.ndarray, batch_size: int = 8,
                           language_names: Sequence[str] = ()) -> dict[str, Any]:
    """Overall and per-language perplexity, bits-per-byte and next-token accuracy."""
    return tally_sequences(sequences, lambda batch: score_batch(model, batch, pad_id, byte_len), batch_size,
                           language_names)


def tally_sequences(sequences: Sequence[EvalSequence], scorer: Scorer, batch_size: int = 8,
                    language_names: Sequence[str] = ()) -> dict[str, Any]:
    """Overall and per-language metrics of any scorer (the model, the unigram baseline): one code path
    decides which targets count and where their bytes go, so two scorers compare on the same bytes."""
    overall, per_lang, entities = Tally(), {}, Tally()
    for i in range(0, len(sequences), batch_size):
        chunk = sequences[i : i + batch_size]
        scored = scorer([np.asarray(s.tokens) for s in chunk])
        for seq, cols in zip(chunk, scored, strict=True):
            overall.add(_tally(cols, cols["scored"]))
            if seq.entity is not None:  # the entity loss's effect: accuracy and bpb on entity targets
                entities.add(_tally(cols, cols["scored"] & (np.asarray(seq.entity)[: len(cols["scored"])] > 0)))
            if isinstance(seq.lang, np.ndarray):
                lang = np.asarray(seq.lang)[: len(cols["scored"])]
                if len(lang) != len(cols["scored"]):
                    raise ValueError(f"evaluate: {len(lang)} target languages for {len(cols['scored'])} targets")
                for li in np.unique(lang):
                    if 0 <= li < len(language_names):
                        per_lang.setdefault(language_names[li], Tally()).add(
                            _tally(cols, cols["scored"] & (lang == li)))
            else:
                per_lang.setdefault(seq.lang or "und", Tally()).add(_tally(cols, cols["scored"]))
    out = {"overall": overall.metrics(), "per_language": {k: v.metrics() for k, v in sorted(per_lang.items())}}
    if any(s.entity is not None for s in sequences):
        out["entities"] = entities.metrics()
    return out


# -- generation ---------------------------------------------------------------------------------------
@torch.no_grad()
def generate(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int
             ) -> dict[str, Any]:
    """Greedy completions and decode speed. Every prompt decodes exactly ``max_new_tokens`` tokens
    (end-of-text does not stop it) so tokens/s of two models compare like with like; the shown
    completion is cut at the first end-of-text. The rows hold results only; the speed is beside them."""
    dev = model_device(model)
    eos = tokenizer.eos_token_id
    rows, new_tokens, seconds = [], 0, 0.0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    warm = torch.tensor([[eos]], device=dev)  # first call pays one-off setup; keep it out of tokens/s
    model.generate(input_ids=warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False,
                   pad_token_id=pad)
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        if ids.shape[1] == 0:
            ids = torch.tensor([[tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos]])
        ids = ids.to(dev)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, use_cache=True, pad_token_id=pad)
        dt = time.perf_counter() - t0
        gen = out[0, ids.shape[1]:].tolist()
        new_tokens += len(gen)
        seconds += dt
        shown = gen[: gen.index(eos)] if eos in gen else gen
        rows.append({"prompt": prompt, "completion": tokenizer.decode(shown, skip_special_tokens=True),
                     "new_tokens": len(gen)})
    return {"generations": rows, "generation_seconds": round(seconds, 4),
            "generation_tokens_per_s": new_tokens / seconds if seconds else float("nan")}


# -- multiple choice ----------------------------------------------------------------------------------
# scored by lm-evaluation-harness (llmpipe/evaluation/harness.py); here each line is checked first
def load_task(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Examples of a JSONL multiple-choice file; a bad line raises naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"evaluate.tasks: no task file at {path}")
    out = []
    for where, ex in jsonl_values(path):
        if not isinstance(ex, dict) or not isinstance(ex.get("context"), str):
            raise ValueError(f"{where}: needs a string 'context'")
        ch = ex.get("choices")
        if not isinstance(ch, list) or len(ch) < 2 or not all(isinstance(c, str) and c for c in ch):
            raise ValueError(f"{where}: 'choices' must be a list of at least 2 non-empty strings")
        lab = ex.get("label")
        if not isinstance(lab, int) or isinstance(lab, bool) or not 0 <= lab < len(ch):
            raise ValueError(f"{where}: 'label' must be an integer in [0, {len(ch)}), got {lab!r}")
        out.append({"context": ex["context"], "choices": ch, "label": lab})
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"evaluate.tasks: {path} holds no examples")
    return out


# -- everything ---------------------------------------------------------------------------------------
def evaluate_model(model: torch.nn.Module, tokenizer: Any, sequences: Sequence[EvalSequence], *,
                   batch_size: int = 8, prompts: Sequence[str] = (), max_new_tokens: int = 32,
                   byte_len: np.ndarray | None = None, language_names: Sequence[str] = ()) -> dict[str, Any]:
    """All metrics of one model on one set of held-out sequences (the gate calls this twice).

    ``res["timings"]`` holds how long it took (``lm_seconds``, ``generation_seconds``,
    ``generation_tokens_per_s``); everything else is a pure function of the model and the data.
    """
    if not sequences:
        raise ValueError("evaluate: no held-out sequences to evaluate on")
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    if byte_len is None:
        byte_len = token_byte_lengths(tokenizer)
    vocab = model.get_output_embeddings().weight.shape[0] if hasattr(model, "get_output_embeddings") else None
    if vocab is not None and len(byte_len) < vocab:  # ids the tokenizer never produces spell no bytes
        byte_len = np.concatenate([byte_len, np.zeros(vocab - len(byte_len), dtype=np.int64)])
    res = language_model_metrics(model, sequences, tokenizer.pad_token_id, byte_len, batch_size, language_names)
    timings: dict[str, Any] = {"lm_seconds": round(time.perf_counter() - t0, 3)}
    if prompts:
        gen = generate(model, tokenizer, prompts, max_new_tokens)
        res["generations"] = gen.pop("generations")
        timings.update(gen)
    res["timings"] = timings
    model.train(was_training)
    return res
