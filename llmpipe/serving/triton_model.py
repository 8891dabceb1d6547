"""Triton Python-backend model for text generation; the deploy stage copies this file to ``<model>/<v>/model.py``.

It is self-contained (torch + transformers only, no llmpipe import) so the same file runs in NVIDIA's
Triton image. The same file serves two models of the repository: the batch model (one response per
request) and, where its config.pbtxt says ``model_transaction_policy { decoupled: true }``, the
streaming model (a response per generated token, or per few: ``stream_linger_ms``, see :class:`Outbox`;
the last one flagged final). Why the tensors
look the way they do:

* Text travels as UTF-8 bytes in ``UINT8`` tensors, not ``BYTES``: with numpy 2 the Python backend
  stub of Triton 2.51 (built against numpy 1) corrupts every multi-element tensor it converts to
  numpy (``as_numpy`` repeats the first element) and crashes deserialising ``BYTES`` inputs. Every
  tensor therefore moves through DLPack (``to_dlpack`` / ``Tensor.from_dlpack``), never numpy.
  Clients speak OpenAI's API to the front end (``llmpipe/serving/openai_api.py``), which sends ids.
* A request is one prompt (shape ``[1, n]``; ``[k, n]`` is refused, not merged) with its own
  sampling (``temperature``, ``top_k``, ``top_p``, ``seed``); a prompt and its ``max_tokens`` must
  fit the model's positions together (refused, naming the context length, otherwise).
* The batch model: the dynamic batcher hands ``execute`` several requests at once; they are
  generated together as one left-padded batch (that is where batching pays), whatever their
  sampling (one forward pass per step), and each request gets its own response or its own error,
  so one bad request never fails its neighbours. With Triton's response cache on (its key: the
  inputs), a sampled request must carry a seed, else one sampled answer would be replayed to all.
* The streaming model batches in flight: ``execute`` hands its streams to a generation thread and
  returns, and a stream joins the running batch at its next step and leaves it at its last token
  (:class:`RunningBatch`), so a stream that arrives while others run waits for its own prefill, not
  for their whole answers. Their KV cache is preallocated, a row per stream (a join or a leave moves
  no other row), and a prompt is prefilled in chunks, each in the running streams' next decode
  step's forward pass. At most ``max_waiting`` streams wait for a row (more are refused at once,
  ``overloaded``: a queue out of Triton's sight must not grow without bound), and a waiting stream
  whose client cancelled is dropped before its prefill. The gauge ``llmpipe_streams{state="running"|"waiting"}`` shows both
  counts (Triton's queue metrics cannot).
* Triton counts a request the Python backend answers with an error response as a success
  (``nv_inference_request_success``); the requests this model refuses are counted in a metric of
  its own, ``llmpipe_request_errors_total`` (reason ``refused``: invalid requests, ``failed``: a
  batch whose generation raised, ``overloaded``: the waiting list was full), which the error-rate
  alert adds to Triton's failures.
"""

from __future__ import annotations

import collections
import functools
import gc
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

try:  # present inside the Triton Python backend only; the generation core is testable without it
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - exercised by the real-server tests
    pb_utils = None

CHECKPOINT_DIR = "checkpoint"
SETTINGS_FILE = "llmpipe_serving.json"
ERRORS_METRIC = "llmpipe_request_errors_total"  # requests answered with an error, by reason
TOKENS_METRIC = "llmpipe_generated_tokens_total"  # new tokens sent to clients
PASSES_METRIC = "llmpipe_stream_forward_passes_total"  # the streaming model's forward passes (prefill or step)
RESPONSES_METRIC = "llmpipe_stream_responses_total"  # the streaming model's responses that carried tokens
UNSTARTED_METRIC = "llmpipe_stream_cancelled_unstarted_total"  # streams cancelled while they waited: never prefilled
STREAMS_METRIC = "llmpipe_streams"  # the streaming model's open streams now, by state (running / waiting)
STREAM_SWITCH_INTERVAL_S = 0.0005  # the streaming model's GIL switch interval (see initialize)
PASSES_REPORT_EVERY = 64  # passes between two increments of it while streams run (and whenever it idles)
CANCEL_CHECK_EVERY = 4  # the outbox asks whether a stream's client cancelled every this many of its tokens
PREFILL_CHUNK_TOKENS = 128  # prompt tokens per forward pass of the streaming model (see RunningBatch)
# a packed pass's attention scores (its tokens x the cached columns it reads) at most this many, else a
# join's chunk gets a pass of its own: the dense mask and the scores grow as rows x positions x tokens
# (31 rows of 200 positions and a 128-token chunk: 76 ms packed, 13 ms in two passes)
PACK_LIMIT = 1 << 16
STREAM_LINGER_MS = 8.0  # the Outbox's send rounds for running streams start at most this often (see Outbox)

class BadRequest(ValueError):
    """A request the model refuses, with a message meant for the client."""


@dataclass
class GenRequest:
    """One validated request: its prompt's ids, its budget and how its tokens are picked (``temperature``
    0: argmax; else a sample of the ``top_k`` most likely tokens (0: all) within ``top_p`` of the mass,
    drawn from its own generator when it has a ``seed``, so a seeded answer does not depend on its
    neighbours in the batch)."""

    input_ids: list[int]
    max_tokens: int
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Limits:
    """Request bounds; written by the deploy stage into ``llmpipe_serving.json``."""

    max_prompt_tokens: int = 512
    max_tokens_limit: int = 256
    default_max_tokens: int = 16
    max_waiting: int = 64  # streams waiting for a row of the running batch; more are refused (overloaded)
    seeded_sampling: bool = False  # a sampled request must carry a seed (the batch model with Triton's cache)
    stream_linger_ms: float = STREAM_LINGER_MS  # a running stream's tokens leave at most this often (Outbox)
    prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS  # prompt tokens per forward pass (RunningBatch)

    @classmethod
    def load(cls, path: str) -> Limits:
        if not os.path.exists(path):
            return cls()
        with open(path) as f:
            data = json.load(f)
        return cls(**{k: type(getattr(cls, k))(data[k]) for k in (
            "max_prompt_tokens", "max_tokens_limit", "default_max_tokens", "max_waiting", "seeded_sampling",
            "stream_linger_ms", "prefill_chunk_tokens")
            if k in data})


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask: 0 where ``allowed``, the dtype's lowest value elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def _masks(keep: torch.Tensor, steps: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive 4D attention masks for a left-padded batch: the prompt's (causal, pads hidden) and one
    for all decode steps (slice ``[..., :length]``), built once per batch.

    ``forward`` takes a prepared 4D mask as is (transformers' documented custom-mask input), so no step
    rebuilds the mask from the 2D padding mask (a fifth of a padded batch's decode time at hidden 64).
    A pad position attends to itself only: no query row is fully masked (NaN), and
    no real token ever attends to a pad.
    """
    n, width = keep.shape
    eye = torch.eye(width, dtype=torch.bool, device=keep.device)
    causal = torch.ones(width, width, dtype=torch.bool, device=keep.device).tril()
    allowed = (causal[None] & keep[:, None, :]) | eye[None]
    prompt = _additive(allowed[:, None], dtype)
    full = torch.cat([keep, keep.new_ones((n, steps))], dim=1)
    step = _key_mask(full, dtype)
    return prompt, step


def _key_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive 4D mask of one decode step: each row's query sees its real positions (``keep``)."""
    return _additive(keep[:, None, None, :], dtype)


CPU_ATTENTION = "llmpipe_sdpa_gqa"  # the attention the model runs with on CPU (register_cpu_attention)


def sdpa_gqa_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, but grouped-query heads go to SDPA as they are (``enable_gqa``)
    even with a mask.

    Stock ``sdpa`` copies the key and value heads out to the query heads (``repeat_kv``) whenever a
    mask is given, because CUDA's kernels fall back to the math path for a mask with GQA. On CPU the
    flash kernel takes both: for a padded batch of 8 one decode step's attention costs 14 µs instead
    of 25 µs per layer at the tiny model's shapes, the same numbers (``test_serving_model`` pins the
    outputs to stock ``sdpa``). A served batch is padded whenever its prompts differ in length, so
    this is the batched model's common case. Registered only for CPU models (``Generator``).
    """
    groups = getattr(module, "num_key_value_groups", 1)
    causal = query.shape[2] > 1 and attention_mask is None and (
        is_causal if is_causal is not None else getattr(module, "is_causal", True))
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


def register_cpu_attention() -> str:
    """Make :func:`sdpa_gqa_attention` loadable by name (``attn_implementation=CPU_ATTENTION``), with
    stock SDPA's mask builder for callers that pass 2D padding masks (``generate``)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(CPU_ATTENTION, sdpa_gqa_attention)
    AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
    return CPU_ATTENTION


def row_generators(rows: list[Any], rng: torch.Generator | None) -> list[torch.Generator | None]:
    """Each row's generator: its own, seeded, when its request has a ``seed``; else the shared ``rng``
    (None: torch's default one)."""
    return [rng if getattr(r, "seed", None) is None else torch.Generator().manual_seed(int(r.seed)) for r in rows]


def pick_tokens(logits: torch.Tensor, rows: list[Any], gens: list[torch.Generator | None]) -> torch.Tensor:
    """Next token per row in one pass whatever the rows' sampling: argmax for a row of temperature 0,
    else a draw from softmax(logits / temperature) cut to its ``top_k`` / ``top_p``, with one uniform
    number from the row's generator (inverse CDF), so rows of different temperatures share the pass."""
    picked = logits.argmax(dim=-1)
    hot = [i for i, r in enumerate(rows) if r.temperature > 0]
    if not hot:
        return picked
    idx = torch.tensor(hot, dtype=torch.long, device=logits.device)
    temps = torch.tensor([rows[i].temperature for i in hot], dtype=torch.float32, device=logits.device)
    probs = _cut(torch.softmax(logits[idx].float() / temps[:, None], dim=-1),
                 [int(getattr(rows[i], "top_k", 0)) for i in hot], [float(getattr(rows[i], "top_p", 1.0)) for i in hot])
    cdf = probs.cumsum(dim=-1)
    u = torch.stack([torch.rand((), generator=gens[i]) for i in hot]).to(logits.device)
    choice = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).reshape(-1)
    picked[idx] = choice.clamp(max=logits.shape[-1] - 1)
    return picked


def _cut(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """``probs`` with each row's tokens outside its ``top_k`` most likely (0: no cut) and outside the
    smallest set of mass ``top_p`` (1: no cut) zeroed; the most likely token always stays."""
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return probs
    ranked, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.tensor([v if v > 0 else probs.shape[-1] for v in top_k], device=probs.device)[:, None]
    p = torch.tensor(top_p, dtype=probs.dtype, device=probs.device)[:, None]
    drop = (rank >= k) | ((ranked.cumsum(dim=-1) - ranked) >= p)
    drop[:, 0] = False
    return torch.zeros_like(probs).scatter(-1, order, ranked.masked_fill(drop, 0.0))


@torch.inference_mode()
def decode_batch(model: Any, ids: torch.Tensor, keep: torch.Tensor, budgets: list[int], eos_ids: set[int],
                 temperature: float = 0.0, rng: torch.Generator | None = None,
                 rows: list[GenRequest] | None = None) -> list[list[int]]:
    """Greedy or sampled decoding of a left-padded batch with the model's own forward and a KV cache.

    The loop ``generate`` runs, without its per-call and per-step machinery (logits processors,
    stopping criteria, streamer, mask rebuild), which adds about a third to a tiny model's forward
    passes; 16 tokens for 8 requests then take about 1.25 times what they take for one. Greedy output
    equals ``model.generate`` greedy output (a test pins it). ``keep`` marks real tokens (False on the
    left padding). Row ``i`` gets at most ``budgets[i]`` tokens and stops after an end-of-sequence
    token; the loop ends when every row is done. ``rows``: each row's request, whose sampling it
    follows (:func:`pick_tokens`: rows of different temperatures in one pass); without them every row
    is sampled at ``temperature``. (Streams are decoded by :class:`RunningBatch`.)
    """
    from transformers import DynamicCache

    n, width = ids.shape
    rows = rows if rows is not None else [GenRequest([], 1, temperature)] * n
    gens = row_generators(rows, rng)
    steps = max(budgets)
    padded = not bool(keep.all())
    pos = keep.long().cumsum(-1) - 1
    pos = pos.masked_fill(~keep, 1)  # as generate: pads get a position that never matters
    prompt_mask, step_mask = _masks(keep, steps, model.dtype) if padded else (None, None)
    cache = DynamicCache()
    out: list[list[int]] = [[] for _ in range(n)]
    live = [b > 0 for b in budgets]
    x, mask, length = ids, prompt_mask, width
    for _ in range(steps):
        logits = model(input_ids=x, attention_mask=mask, position_ids=pos, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1, :]
        picked = pick_tokens(logits, rows, gens)
        for row, tok in enumerate(picked.tolist()):
            if not live[row]:
                continue
            out[row].append(tok)
            live[row] = len(out[row]) < budgets[row] and tok not in eos_ids
        if not any(live):
            break
        length += 1
        x, pos = picked[:, None], pos[:, -1:] + 1
        mask = None if step_mask is None else step_mask[..., :length]
    return out


@dataclass
class Stream:
    """One streaming request of a :class:`RunningBatch`: ``on_token(token, last)`` sees each new token
    and ends the stream early by returning True (its client cancelled)."""

    request: GenRequest
    on_token: Callable[[int, bool], bool | None]
    owner: Any = None  # what the caller keeps with the stream (the model: its sender)
    cancelled: Callable[[], bool] | None = None  # asked before its prefill: a stream nobody waits for is dropped
    tokens: int = 0
    done: bool = False
    generator: torch.Generator | None = None  # its own when its request has a seed (set when it joins)
    slot: int = -1  # its row of the batch's cache (set when it joins)
    filled: int = 0  # prompt tokens in the cache so far
    last: int = 0  # its latest token (the next decode step's input)


_HOLE = GenRequest([], 1, 0.0)  # what a decode step's hole row is picked by: argmax, ignored


class _Plan:
    """Where one forward pass's new keys and values go in a :class:`SlotCache` and what attention reads.

    A decode step (``src`` None): ``dst`` holds the column of each of the first rows' one query (a
    ``scatter_`` index shaped like the pass's new keys, ``[rows, kv_heads, 1, head_dim]``), ``read``
    the rows attention reads (a slice: a view of the cache, no copy) and ``length`` the columns (the
    longest row's). A packed pass (one sequence, ``src`` its token indices): ``dst`` the (slot,
    column) each token is written to, ``read`` the (slot, column) of each key attention reads
    (gathered: a copy of those columns only), ``length`` their count."""

    __slots__ = ("src", "dst", "read", "length")

    def __init__(self, src: tuple[torch.Tensor, torch.Tensor] | None, dst: tuple[torch.Tensor, torch.Tensor],
                 read: slice | torch.Tensor, length: int) -> None:
        self.src, self.dst, self.read, self.length = src, dst, read, length


@functools.cache
def _slot_cache_class() -> type:
    """``SlotCache``, a subclass of transformers' public ``Cache`` whose layers (``SlotLayer``) subclass
    its ``CacheLayerMixin``. Defined on first use: importing transformers costs a second or more, and
    the deploy stage imports this module for two names only."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class SlotLayer(CacheLayerMixin):
        """One layer's keys and values, ``[rows, kv_heads, max_len, head_dim]``, allocated once; each
        row is a stream's slot, its tokens at columns 0.. (the column is the position). ``update``
        writes the pass's tokens where the cache's plan says and returns what attention reads."""

        def __init__(self, owner: Any, shape: tuple[int, int, int, int], dtype: torch.dtype,
                     device: torch.device | str) -> None:
            super().__init__()
            self.owner = owner
            self.keys = torch.zeros(shape, dtype=dtype, device=device)
            self.values = torch.zeros(shape, dtype=dtype, device=device)
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            """Nothing to do: the tensors are allocated when the cache is made."""

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            plan = self.owner.plan
            if plan.src is None:  # a decode step: batch row i's one token goes to column dst[i] of row i
                self.keys.scatter_(2, plan.dst, key_states)  # in place, one op (an index write is a dozen)
                self.values.scatter_(2, plan.dst, value_states)
            else:  # a packed pass (one sequence): token i goes to (slot, column) dst[.][i]
                self.keys[plan.dst[0], :, plan.dst[1]] = key_states[0].transpose(0, 1)  # [tokens, heads, dim]
                self.values[plan.dst[0], :, plan.dst[1]] = value_states[0].transpose(0, 1)
            if isinstance(plan.read, tuple):  # the (slot, column) of each key it reads, gathered: a copy
                slots, cols = plan.read
                keys, values = self.keys[slots, :, cols], self.values[slots, :, cols]  # [keys, kv_heads, head_dim]
                return keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
            return self.keys[plan.read, :, :plan.length], self.values[plan.read, :, :plan.length]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.keys.shape[2], 0

        def get_seq_length(self) -> int:
            return 0 if self.owner.plan is None else self.owner.plan.length

        def get_max_length(self) -> int:
            return self.keys.shape[2]

    class SlotCache(Cache):
        """A KV cache of row slots for :class:`RunningBatch`: per layer one preallocated tensor
        ``[max_rows, kv_heads, max_len, head_dim]``. Rows have their own lengths (a stream's tokens
        sit at columns 0.. of its row, so its positions are its columns), so a stream joins by
        writing its prompt into a free row and leaves by freeing it: no other row moves. Before each
        forward pass the batch sets ``plan`` (:class:`_Plan`): which rows and columns the pass writes
        and which part attention reads; the caller's 4D mask hides each row's columns past its length.
        """

        def __init__(self, layers: int, shape: tuple[int, int, int, int], dtype: torch.dtype,
                     device: torch.device | str) -> None:
            self.plan: _Plan | None = None
            super().__init__(layers=[SlotLayer(self, shape, dtype, device) for _ in range(layers)])

    return SlotCache


def slot_cache(model: Any, max_rows: int, max_len: int | None = None) -> Any:
    """A ``SlotCache`` (see :func:`_slot_cache_class`) for ``model``: ``max_rows`` rows of ``max_len``
    positions (default: the model's), shaped from its config (key/value heads, head size, layers), on
    its device and dtype."""
    cfg = model.config.get_text_config()
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    length = int(max_len or cfg.max_position_embeddings)
    return _slot_cache_class()(int(cfg.num_hidden_layers), (max_rows, kv_heads, length, head_dim), model.dtype,
                              model.device)


class RunningBatch:
    """In-flight batching for streams: a stream joins the running batch between two decode steps and
    leaves it at its last token, so a stream that arrives while others generate waits for its own
    prefill, not the others' whole answers.

    The rows live in one preallocated KV cache of row slots (:func:`slot_cache`, ``max_rows`` rows of
    the model's positions): a joining stream takes a free row, its prompt is written into it, and a
    leaving one frees its row; no other row is copied or moved (a decode step writes one position per
    row, in place). Each row's tokens sit at columns 0.. of its row, so its positions are its own
    (as alone) and the additive 4D attention mask hides each row's columns past its length: a row's
    tokens do not depend on who shares its batch (greedy tokens equal :func:`decode_batch` on the
    request alone; a test pins it).

    Chunked prefill: while streams join, :meth:`step` runs one forward pass over at most
    ``chunk_tokens`` prompt tokens (of the joining streams, in arrival order) and the decoding rows'
    next tokens, packed into one sequence, so a running stream waits for one chunk between two
    tokens, never for a whole long prompt, and a short join costs no pass of its own (a large one,
    past ``pack_limit``, gets a pass of its own before the decode step). A stream gets its first
    token from the pass that holds its prompt's last chunk. Otherwise a step is a plain decode pass
    over the rows (:meth:`_decode`).
    """

    def __init__(self, model: Any, eos_ids: set[int], pad_id: int, rng: torch.Generator | None = None,
                 max_rows: int = 8, chunk_tokens: int = PREFILL_CHUNK_TOKENS, pack_limit: int = PACK_LIMIT) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.model, self.eos_ids, self.pad_id, self.rng = model, eos_ids, pad_id, rng
        self.max_rows, self.chunk_tokens, self.pack_limit = max_rows, chunk_tokens, pack_limit
        self.cache = slot_cache(model, max_rows)  # allocated once, for the model's life
        self.device = model.device  # read once: the property walks the model's parameters (40 µs a call)
        # each row's decode mask, kept across steps: a row's columns 0..its length are open (0), the
        # rest closed (the dtype's lowest); a step opens one column per row, a join closes its row
        self.mask = _additive(torch.zeros((max_rows, 1, 1, self.cache.layers[0].get_max_length()),
                                          dtype=torch.bool, device=self.device), model.dtype)
        self.head_shape = (self.cache.layers[0].keys.shape[1], 1, self.cache.layers[0].keys.shape[3])
        self.slots: list[Stream | None] = [None] * max_rows
        self.prefilling: list[Stream] = []  # joined, prompt not all in the cache yet (arrival order)
        self.passes = 0  # forward passes run (prefill chunks and steps): tokens / passes is the mean batch

    @property
    def streams(self) -> list[Stream]:
        """The rows' streams, prefilling or decoding, in row order."""
        return [s for s in self.slots if s is not None]

    def __len__(self) -> int:
        return sum(s is not None for s in self.slots)

    def close_all(self) -> list[Stream]:
        """Drop every row (after a failed step); returns the streams that were still open."""
        open_ = [s for s in self.streams if not s.done]
        self.slots = [None] * self.max_rows
        self.prefilling = []
        return open_

    def add(self, streams: list[Stream]) -> None:
        """Give each of ``streams`` a free row; their prompts are prefilled by the next steps."""
        free = [i for i, s in enumerate(self.slots) if s is None]
        if len(streams) > len(free):
            raise RuntimeError(f"{len(streams)} streams join but only {len(free)} of {self.max_rows} rows are free")
        positions = self.cache.layers[0].get_max_length()
        for s in streams:  # parse refuses these; checked before any row is taken
            if len(s.request.input_ids) + s.request.max_tokens - 1 > positions:
                raise ValueError(f"prompt ({len(s.request.input_ids)} tokens) + max_tokens ({s.request.max_tokens}) "
                                 f"is over the model's {positions} positions")
        for s, slot, g in zip(streams, free, row_generators([s.request for s in streams], self.rng), strict=False):
            s.slot, s.filled, s.generator = slot, 0, g
            self.mask[slot].fill_(torch.finfo(self.mask.dtype).min)  # its predecessor's columns: closed
            self.slots[slot] = s
            self.prefilling.append(s)

    @torch.inference_mode()
    def step(self) -> None:
        """One prefill chunk (when streams are joining) and one decode step for every row that has its
        first token: each gets its next token. Both go in one packed pass while it stays small
        (``pack_limit``), else the chunk gets a pass of its own and the decode step follows."""
        decoding = [s for s in self.slots if s is not None and s.filled == len(s.request.input_ids)]
        if self.prefilling:
            chunk = self._chunk()
            tokens = len(decoding) + sum(n for _, _, n in chunk)
            keys = sum(s.filled + s.tokens for s in decoding) + sum(start + n for _, start, n in chunk)
            if not decoding or tokens * keys <= self.pack_limit:
                self._packed(chunk, decoding)
                return
            self._packed(chunk, [])
            decoding = [s for s in self.slots if s is not None and s.filled == len(s.request.input_ids)]
        if decoding:
            self._decode(decoding)

    def _chunk(self) -> list[tuple[Stream, int, int]]:
        """The next at most ``chunk_tokens`` prompt tokens of the joining streams, in arrival order:
        (stream, first column, tokens) per stream."""
        parts: list[tuple[Stream, int, int]] = []
        budget = self.chunk_tokens
        for s in self.prefilling:
            n = min(len(s.request.input_ids) - s.filled, budget)
            if n <= 0:
                break
            parts.append((s, s.filled, n))
            budget -= n
        return parts

    def _packed(self, chunk: list[tuple[Stream, int, int]], decoding: list[Stream]) -> None:
        """One forward pass over a prefill ``chunk`` and the ``decoding`` rows' next tokens, packed into
        one sequence (no padding: a join costs its prompt's tokens, not a second pass, nor a pass over
        every row padded to the prompt's length, which at 8 rows and 16-token prompts cost as much as
        two passes). Each token attends to its own row's columns up to its position, gathered from
        the cache (:class:`_Plan`); a decoding stream gets its next token, a stream whose prompt the
        chunk completes its first."""
        parts = ([(s, s.filled + s.tokens - 1, [s.last]) for s in decoding]
                 + [(s, start, s.request.input_ids[start:start + n]) for s, start, n in chunk])
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []  # each token's slot
        key_rows: list[int] = []  # the columns attention reads: (slot, column) of each
        key_cols: list[int] = []
        ends: list[int] = []  # the packed index of each emitting part's last token
        done: list[Stream] = []
        for s, start, toks in parts:
            ids += toks
            pos += range(start, start + len(toks))
            rows += [s.slot] * len(toks)
            key_rows += [s.slot] * (start + len(toks))
            key_cols += range(start + len(toks))
            if start + len(toks) >= len(s.request.input_ids):
                ends.append(len(ids) - 1)
                done.append(s)
        device = self.device
        q = torch.tensor([ids, pos, rows], dtype=torch.long, device=device)
        k = torch.tensor([key_rows, key_cols], dtype=torch.long, device=device)
        dst = (q[2], q[1])
        self.cache.plan = _Plan(torch.arange(len(ids), device=device), dst, (k[0], k[1]), len(key_cols))
        allowed = (k[0][None, :] == q[2][:, None]) & (k[1][None, :] <= q[1][:, None])  # its row, up to itself
        mask = _additive(allowed[None, None], self.model.dtype)
        logits = self.model(input_ids=q[0][None], attention_mask=mask, position_ids=q[1][None],
                            past_key_values=self.cache, use_cache=True,
                            logits_to_keep=torch.tensor(ends or [len(ids) - 1], device=device)).logits[0]
        self.passes += 1
        self.mask.view(self.max_rows, -1).index_put_(dst, torch.zeros((), dtype=self.mask.dtype, device=device))
        for s, _, n in chunk:
            s.filled += n  # the columns just written: its decode steps see them (opened above)
        if not done:
            return
        self.prefilling = [s for s in self.prefilling if s.filled < len(s.request.input_ids)]
        self._emit(done, pick_tokens(logits[:len(done)], [s.request for s in done],
                                     [s.generator for s in done]).tolist())

    def _decode(self, rows: list[Stream]) -> None:
        """One decode step: the forward pass runs over rows ``0..last used`` and writes one column of
        each (a plain per-row index, no gather of the rows that decode). A row without a decoding
        stream in that range is a hole: fed a pad at a column nobody reads yet (a free row's column 0,
        a prefilling row's next prompt column, which its next chunk overwrites), its token ignored.

        What a step builds is small on purpose (at the tiny model's size a step is under 2 ms and each
        tensor op costs µs): one tensor of ids and positions from plain lists, one ``scatter_`` opening
        each row's new column in the kept mask (:attr:`mask`), one per layer writing its keys (and
        values), the mask and the cache read as views (SDPA takes a strided mask without a copy)."""
        width = rows[-1].slot + 1
        ids, pos = [self.pad_id] * width, [0] * width  # plain lists: cheaper than index writes per step
        reqs: list[GenRequest] = [_HOLE] * width
        gens: list[torch.Generator | None] = [None] * width
        for s in self.prefilling:
            if s.slot < width:
                pos[s.slot] = s.filled
        for s in rows:
            ids[s.slot], pos[s.slot] = s.last, s.filled + s.tokens - 1  # its cached positions: the next column
            reqs[s.slot], gens[s.slot] = s.request, s.generator
        inputs = torch.tensor([ids, pos], dtype=torch.long, device=self.device)
        cols = inputs[1].view(width, 1, 1, 1)
        length = max(pos) + 1
        self.cache.plan = _Plan(None, cols.expand(width, *self.head_shape), slice(0, width), length)
        self.mask.scatter_(3, cols, 0.0)  # each row's new column: open
        mask = self.mask[:width, :, :, :length]  # a strided view: SDPA takes it as it is (timed: no copy)
        logits = self.model(input_ids=inputs[0, :, None], attention_mask=mask, position_ids=inputs[1, :, None],
                            past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]
        self.passes += 1
        picked = pick_tokens(logits, reqs, gens).tolist()
        self._emit(rows, [picked[s.slot] for s in rows])

    def _emit(self, streams: list[Stream], picked: list[int]) -> None:
        """Hand ``streams`` their picked tokens; free the rows of those that ended."""
        for s, tok in zip(streams, picked, strict=True):
            s.tokens += 1
            s.last = tok
            last = s.tokens >= s.request.max_tokens or tok in self.eos_ids
            s.done = last
            if s.on_token(tok, last):
                s.done = True
            if s.done:
                self.slots[s.slot] = None  # the row is free; nothing else moves


class Generator:
    """Batched greedy / sampled generation with per-request validation."""

    def __init__(self, checkpoint: str, limits: Limits, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        # on a GPU stock SDPA (its GQA kernels want no mask); on CPU ours, which keeps GQA with a mask
        attn = register_cpu_attention() if device == "cpu" else "sdpa"
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation=attn).to(device).eval()
        self.attention = attn
        self.device = device
        self.limits = limits
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self.pad_id = int(pad)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        # the positions the model has: a prompt and its new tokens must fit in them together
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None

    # -- validation -------------------------------------------------------------------------------
    def parse(self, prompt: bytes | None, input_ids: list[int] | None, max_tokens: int | None,
              temperature: float | None, top_k: int | None = None, top_p: float | None = None,
              seed: int | None = None) -> GenRequest:
        """Turn raw inputs into a GenRequest or raise BadRequest saying exactly what is wrong."""
        parsed = self.parse_batch([(prompt, input_ids, max_tokens, temperature, top_k, top_p, seed)])[0]
        if isinstance(parsed, BadRequest):
            raise parsed
        return parsed

    def parse_batch(self, raw: list[tuple[Any, ...]]) -> list[GenRequest | BadRequest]:
        """:meth:`parse` for each of a batch's requests (prompt, input_ids, max_tokens, temperature[,
        top_k, top_p, seed]): a GenRequest, or the BadRequest that says what is wrong with it. The
        batch's text prompts are tokenized in one call (the tokenizer's fixed cost per call is most
        of a short prompt's)."""
        checked = [self._check(*r) for r in raw]
        texts = [c[0] for c in checked if not isinstance(c, BadRequest) and isinstance(c[0], str)]
        encoded = iter(self.tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else [])
        out: list[GenRequest | BadRequest] = []
        for c in checked:
            if isinstance(c, BadRequest):
                out.append(c)
                continue
            what, req = c
            req.input_ids = list(next(encoded)) if isinstance(what, str) else what
            out.append(self._fits(req))
        return out

    def _fits(self, req: GenRequest) -> GenRequest | BadRequest:
        """``req``, or why its prompt is too long for the limit or, with its new tokens, for the model."""
        n = len(req.input_ids)
        if n > self.limits.max_prompt_tokens:
            return BadRequest(f"prompt has {n} tokens, over the limit of {self.limits.max_prompt_tokens}")
        if self.context is not None and n + req.max_tokens > self.context:
            return BadRequest(f"prompt ({n} tokens) + max_tokens ({req.max_tokens}) = {n + req.max_tokens} is over "
                              f"the model's context length of {self.context} tokens")
        return req

    def _check(self, prompt: bytes | None, input_ids: list[int] | None, max_tokens: int | None,
               temperature: float | None, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None) -> tuple[str | list[int], GenRequest] | BadRequest:
        """Everything but a text prompt's length in tokens, known once the batch is tokenized: (the
        prompt's text or ids, the request without its ids yet), or what is wrong."""
        try:
            if (prompt is None) == (input_ids is None):
                raise BadRequest("send exactly one of 'prompt' (UTF-8 bytes as UINT8) or 'input_ids' (INT64)")
            if prompt is not None:
                try:
                    what: str | list[int] = prompt.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadRequest(f"'prompt' is not valid UTF-8: {e}") from None
                if not what.strip():
                    raise BadRequest("'prompt' is empty")
            else:
                what = list(input_ids or [])
                if not what:
                    raise BadRequest("'input_ids' is empty")
                bad = [t for t in what if t < 0 or t >= self.vocab_size]
                if bad:
                    raise BadRequest(f"'input_ids' has ids outside [0, {self.vocab_size}): {bad[:5]}")
            n = self.limits.default_max_tokens if max_tokens is None else int(max_tokens)
            if not 1 <= n <= self.limits.max_tokens_limit:
                raise BadRequest(f"'max_tokens' must be in [1, {self.limits.max_tokens_limit}], got {n}")
            t = 0.0 if temperature is None else float(temperature)
            if not (t >= 0.0 and t <= 10.0):  # also rejects NaN
                raise BadRequest(f"'temperature' must be in [0, 10], got {t}")
            k = 0 if top_k is None else int(top_k)
            if k < 0:
                raise BadRequest(f"'top_k' must be >= 0 (0: no cut), got {k}")
            p = 1.0 if top_p is None else float(top_p)
            if not (0.0 < p <= 1.0):
                raise BadRequest(f"'top_p' must be in (0, 1], got {p}")
            if t > 0 and seed is None and self.limits.seeded_sampling:
                raise BadRequest("a sampled request (temperature > 0) to this model needs a 'seed': its response "
                                 "cache keys on the inputs and would replay one sampled answer to every such request")
        except BadRequest as e:
            return e
        return what, GenRequest([], n, t, k, p, None if seed is None else int(seed))

    # -- generation -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, reqs: list[GenRequest]) -> list[list[int]]:
        """New token ids per request, all requests in one padded batch whatever their sampling."""
        width = max(len(r.input_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        keep = torch.zeros((len(reqs), width), dtype=torch.bool)
        for row, r in enumerate(reqs):  # left padding: every prompt ends at the same position
            ids[row, width - len(r.input_ids):] = torch.tensor(r.input_ids, dtype=torch.long)
            keep[row, width - len(r.input_ids):] = True
        return decode_batch(self.model, ids.to(self.device), keep.to(self.device), [r.max_tokens for r in reqs],
                            self.eos_ids, rows=reqs)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


class TextDeltas:
    """The text each new token adds, so the concatenated pieces equal the decoded answer.

    Incremental: ``tokenizers``' ``DecodeStream`` decodes each token with the few before it that it
    needs (a constant cost per token, where decoding the whole answer so far at each token made a
    stream of n tokens cost n² / 2 token decodes). A byte-level token can end inside a multi-byte
    character; its text is held back until the token that completes it arrives. The last token's
    piece is taken from one decode of the whole answer (once per stream), so the pieces add up to
    exactly what ``decode`` gives, U+FFFD for a character left incomplete included.
    """

    def __init__(self, decode: Callable[[list[int]], str], tokenizer: Any = None) -> None:
        from tokenizers.decoders import DecodeStream

        self.decode = decode
        self.backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer of a fast one
        self.stream = DecodeStream(skip_special_tokens=True) if self.backend is not None else None
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, token: int, last: bool) -> str:
        self.tokens.append(token)
        if last or self.stream is None:
            text = self.decode(self.tokens)
            if not last and text.endswith("\ufffd"):
                return ""
            piece = text[len(self.sent):] if text.startswith(self.sent) else text
            self.sent = text
            return piece
        piece = self.stream.step(self.backend, token) or ""
        self.sent += piece
        return piece


# -- the Triton side -----------------------------------------------------------------------------
def _raw_request(request: Any) -> tuple[Any, ...]:
    """A request's (prompt, input_ids, max_tokens, temperature, top_k, top_p, seed) as plain values,
    its inputs read once through DLPack (see the module docstring); BadRequest for a scalar input of
    several values, or a prompt of several rows (a request is one prompt: its batch dimension is 1)."""
    inputs = {t.name(): torch.from_dlpack(t.to_dlpack()) for t in request.inputs()}
    prompt, ids = _one_row(inputs.get("prompt"), "prompt"), _one_row(inputs.get("input_ids"), "input_ids")
    max_tokens, top_k, seed = (_scalar(inputs.get(n), n) for n in ("max_tokens", "top_k", "seed"))
    return (None if prompt is None else bytes(prompt.reshape(-1).to(torch.uint8).tolist()),
            None if ids is None else [int(x) for x in ids.reshape(-1).tolist()],
            None if max_tokens is None else int(max_tokens),
            _scalar(inputs.get("temperature"), "temperature"),
            None if top_k is None else int(top_k), _scalar(inputs.get("top_p"), "top_p"),
            None if seed is None else int(seed))


def _one_row(t: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """A prompt tensor of shape [1, n] (or [n]); a request of k prompts ([k, n]) would otherwise be
    read as one prompt of k * n tokens with one answer."""
    if t is not None and t.dim() > 1 and t.shape[0] != 1:
        raise BadRequest(f"'{name}' has shape {list(t.shape)}: send one prompt per request (shape [1, n]); "
                         f"{t.shape[0]} prompts are {t.shape[0]} requests")
    return t


def _scalar(t: torch.Tensor | None, name: str) -> float | None:
    if t is None:
        return None
    if t.numel() != 1:
        raise BadRequest(f"'{name}' must hold one value per request, got shape {list(t.shape)}")
    return t.reshape(-1)[0].item()


def _out(name: str, t: torch.Tensor) -> Any:
    return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(t.contiguous()))


def _bad_request(message: str) -> Any:
    """An INVALID_ARG error (HTTP 400 / gRPC INVALID_ARGUMENT) where the backend supports error codes."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)


def _overloaded(message: str) -> Any:
    """An UNAVAILABLE error (gRPC UNAVAILABLE; the OpenAI front end answers 429) where codes exist."""
    code = getattr(pb_utils.TritonError, "UNAVAILABLE", None)
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)


def _answer(text: str, tokens: list[int]) -> Any:
    raw = text.encode("utf-8")
    return pb_utils.InferenceResponse(output_tensors=[
        _out("text", torch.tensor(list(raw), dtype=torch.uint8).reshape(1, -1)),
        _out("output_ids", torch.tensor(tokens, dtype=torch.long).reshape(1, -1)),
    ])


@dataclass
class Tokens:
    """New tokens of one stream not yet sent: their ids and the text they add."""

    text: str
    ids: list[int]


class Outbox:
    """Sends the streams' responses from a thread of its own, in the order they were put.

    A send is a round trip to the Triton server process (it waits while the server takes the
    response); with 8 streams a step's 8 sends took several times the tiny model's forward pass. On
    this thread they overlap the next step's forward instead of adding to it (sending from another
    thread is how Triton's decoupled examples answer). When the sends fall behind the decode steps,
    the :class:`Tokens` of one stream that wait in the queue together go out as one response (the
    ids and text concatenated, the FINAL flag kept): each token still leaves as soon as the thread
    can send, and a stream never waits for a send of tokens it already has. A send that raises
    marks its stream broken (``on_broken`` sees it once) and the stream's later responses are
    dropped. ``respond(text, ids)`` builds the response of some tokens; ``on_send(stream, tokens,
    flags)`` sees each send just before it leaves (``tokens``: whether it carries any).

    ``linger_s``: when the next send is a running stream's next tokens (not its first response, not
    its last, not an error), the thread waits until ``linger_s`` has passed since its last send round
    began, so a round carries each stream's tokens of about ``linger_s`` of decoding in one response.
    Every response costs a round trip here, a gRPC message in the server and an event in the API, in
    the processes that share the cores with decoding: with 8 streams they took more CPU than the
    decode steps (0.5 ms of the model's process per token against 0.27 ms for decoding alone). A
    first token, a last one or an error ends a linger under way (``wake``), so it never waits for
    one (TTFT); a later token waits at most ``linger_s``, and a client's mean gap between tokens is
    unchanged (the same tokens arrive in fewer, fuller events).

    A stream's first tokens (before its first response) skip the queue: they wait in a lane of their
    own (``first``), sent before each send of a round. A round of 8 streams' sends took 4-8 ms on 2
    busy cores, and a newcomer's first token put while one was under way waited for the rest of it
    and then for its turn in the next (traced through the server: 5.7 ms median, 60 ms p99 from the
    token to its send, the largest share of the model's part of TTFT). Order within a stream is
    kept: nothing of a stream is queued before its first tokens (an error or a close before them
    ends it), and the lane empties before every later send.
    """

    def __init__(self, on_broken: Callable[[Any], None], respond: Callable[[str, list[int]], Any],
                 on_send: Callable[[Any, bool, int], None] | None = None, linger_s: float = 0.0) -> None:
        self.on_broken, self.respond, self.on_send, self.linger_s = on_broken, respond, on_send, linger_s
        self.round_at = 0.0  # when the last send round began (time.monotonic)
        self.wake = threading.Event()  # set by a send that must not wait: it ends the linger
        self.queue: queue.Queue[tuple[Any, Any, Any, int] | None] = queue.Queue()  # None: look at ``first``
        self.first: collections.deque[tuple[Any, Any, Any, int]] = collections.deque()  # first tokens' lane
        self.thread = threading.Thread(target=self._run, name="llmpipe-outbox", daemon=True)
        self.thread.start()

    def put(self, stream: Any, sender: Any, response: Any, flags: int) -> None:
        """``stream``: an object with a ``broken`` flag (set here when a send fails) and a count of
        its ``responses`` sent (``on_send`` keeps it; absent: 0); ``response``: a response,
        :class:`Tokens`, or None (flags only)."""
        item = (stream, sender, response, flags)
        if isinstance(response, Tokens) and not getattr(stream, "responses", 0):
            self.first.append(item)
            self.queue.put(None)  # the thread may be waiting for the queue: it looks at the lane
        else:
            self.queue.put(item)
        if not _can_wait(item):
            self.wake.set()

    def _run(self) -> None:
        while True:
            head = self.queue.get()
            if head is None:  # first tokens alone: a round of their own (the next tokens linger after it)
                if self.queue.empty():  # nothing else queued set it: the next tokens may linger again
                    self.wake.clear()
                if self.first:
                    self.round_at = time.monotonic()
                self._send_first()
                continue
            waiting = [head]
            if self.linger_s > 0 and _can_wait(head):
                self.wake.wait(max(0.0, self.round_at + self.linger_s - time.monotonic()))
            self.wake.clear()  # what set it is queued: the drain below takes it
            self.round_at = time.monotonic()
            while True:  # everything queued meanwhile: one stream's tokens among it merge
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    waiting.append(item)
            for stream, sender, response, flags in coalesce(waiting):
                self._send_first()  # a first token put meanwhile goes before the rest of the round
                if sender is None:
                    return
                self._send(stream, sender, response, flags)

    def _send_first(self) -> None:
        """Send what waits in the first tokens' lane (a stream's tokens there merged)."""
        while self.first:
            taken = []
            while self.first:
                taken.append(self.first.popleft())
            for stream, sender, response, flags in coalesce(taken):
                self._send(stream, sender, response, flags)

    def _send(self, stream: Any, sender: Any, response: Any, flags: int) -> None:
        if stream.broken:
            return
        try:
            if self.on_send is not None:
                self.on_send(stream, isinstance(response, Tokens), flags)
            if response is None:
                sender.send(flags=flags)
            else:
                if isinstance(response, Tokens):
                    response = self.respond(response.text, response.ids)
                sender.send(response, flags=flags)
        except Exception:  # noqa: BLE001 - its stream is broken; the others go on
            stream.broken = True
            self.on_broken(stream)

    def close(self) -> None:
        self.queue.put((None, None, None, 0))
        self.thread.join(timeout=10)


def _can_wait(item: tuple[Any, Any, Any, int]) -> bool:
    """Whether a queued send may linger: the next tokens of a stream that already had a response."""
    stream, sender, response, flags = item
    return sender is not None and isinstance(response, Tokens) and not flags and getattr(stream, "responses", 0) > 0


def coalesce(items: list[tuple[Any, Any, Any, int]]) -> list[tuple[Any, Any, Any, int]]:
    """Queued sends with each stream's consecutive :class:`Tokens` merged into the first of them.

    Order is kept within a stream, and nothing is moved past a send of another kind (an error, a
    flags-only close, the stop marker), so what a client reads is the same text, ids and final flag.
    """
    out: list[tuple[Any, Any, Any, int]] = []
    open_at: dict[int, int] = {}  # stream -> index in out of its Tokens that can still grow
    for stream, sender, response, flags in items:
        key = id(stream)
        at = open_at.get(key)
        if isinstance(response, Tokens) and at is not None:
            _, first_sender, prev, prev_flags = out[at]
            out[at] = (stream, first_sender, Tokens(prev.text + response.text, prev.ids + response.ids),
                       prev_flags | flags)
            if flags:  # final: nothing of this stream comes after it
                del open_at[key]
            continue
        if sender is None:  # the stop marker: what came before it is sent, nothing after
            out.append((stream, sender, response, flags))
            return out
        open_at.pop(key, None)
        if isinstance(response, Tokens) and not flags:
            open_at[key] = len(out)
        out.append((stream, sender, response, flags))
    return out


class _Sent:
    """What the model keeps per stream: its sender, the tokens it was sent, the responses that carried
    them, whether a send failed, whether its client cancelled (as last asked, at ``asked`` tokens)."""

    def __init__(self, sender: Any = None) -> None:
        self.sender, self.tokens, self.responses, self.broken = sender, 0, 0, False
        self.cancelled, self.asked = False, 0


class StreamScheduler:
    """The streaming model's generation thread around one :class:`RunningBatch`.

    ``execute`` hands it the new streams and returns at once (a decoupled model may answer after
    ``execute`` returned), so Triton passes on the next requests while streams are generating; they
    join the running batch at the next step, up to ``max_rows`` rows (the model's ``max_batch_size``),
    the rest wait for a row to free, at most ``max_waiting`` of them (``submit`` hands back the
    streams beyond: the caller refuses them, overloaded, rather than let a queue nobody sees grow
    without bound). A stream that waited (a step or more: no row was free) whose client cancelled
    is dropped before its prefill
    (``on_cancelled``). A step that raises ends every open stream with ``on_error`` and the thread
    goes on with the next streams. ``report_passes(n)`` gets the forward passes run since its last
    call, every ``PASSES_REPORT_EVERY`` passes and whenever the thread goes idle.
    """

    def __init__(self, batch: RunningBatch, max_rows: int, on_error: Callable[[Stream, Exception], None],
                 report_passes: Callable[[int], None] | None = None, max_waiting: int | None = None,
                 on_cancelled: Callable[[Stream], None] | None = None,
                 on_depth: Callable[[int, int], None] | None = None) -> None:
        self.batch, self.max_rows, self.on_error = batch, max(1, max_rows), on_error
        self.report_passes, self.reported = report_passes, 0
        self.max_waiting, self.on_cancelled = max_waiting, on_cancelled
        self.queued = 0  # streams submitted that have not joined the batch (or been dropped) yet
        self.on_depth, self.depth = on_depth, (0, 0)  # (running, waiting) as last reported
        self.lock = threading.Lock()
        self.inbox: queue.Queue[list[Stream] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="llmpipe-streams", daemon=True)
        self.thread.start()

    def submit(self, streams: list[Stream]) -> list[Stream]:
        """Queue ``streams`` to join the batch; returns those refused because the waiting list is full
        (the free rows count as room: a stream for a free row joins at the next step)."""
        with self.lock:
            room = len(streams) if self.max_waiting is None else max(
                0, self.max_waiting + self.max_rows - len(self.batch) - self.queued)
            taken, refused = streams[:room], streams[room:]
            self.queued += len(taken)
        if taken:
            self.inbox.put(taken)
            self._report_depth()
        return refused

    def _report_depth(self) -> None:
        """``on_depth(running, waiting)`` when either changed: a stream's join, leave or arrival, not a
        token (each report is a round trip to the server)."""
        if self.on_depth is None:
            return
        with self.lock:
            depth = (len(self.batch), self.queued)
            if depth == self.depth:
                return
            self.depth = depth
            self.on_depth(*depth)  # under the lock: two threads' reports cannot land out of order

    def stop(self) -> None:
        self.inbox.put(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        waiting: list[Stream] = []
        fresh: set[int] = set()  # the streams that came during the last step (not asked whether cancelled)
        while True:
            block = not self.batch and not waiting  # idle: wait for streams; busy: take what came
            if block or self.batch.passes - self.reported >= PASSES_REPORT_EVERY:
                self._report()
            while True:
                try:
                    item = self.inbox.get(block=block)
                except queue.Empty:
                    break
                block = False
                if item is None:
                    self._fail([*self.batch.close_all(), *waiting], RuntimeError("the model is unloading"))
                    self._report()
                    return
                waiting.extend(item)
                fresh.update(id(s) for s in item)
            room = self.max_rows - len(self.batch)
            joining: list[Stream] = []
            while waiting and len(joining) < room:  # the ones about to be prefilled: did their clients go?
                take, waiting = waiting[:room - len(joining)], waiting[room - len(joining):]
                joining += self._drop_cancelled(take, fresh)
            fresh.clear()
            with self.lock:
                self.queued -= len(joining)
            try:
                self.batch.add(joining)
                self.batch.step()
            except Exception as e:  # noqa: BLE001 - every open stream gets the error, the model keeps serving
                open_ = self.batch.close_all()
                seen = {id(s) for s in open_}
                self._fail([*open_, *(s for s in joining if not s.done and id(s) not in seen)], e)
            self._report_depth()

    def _drop_cancelled(self, streams: list[Stream], fresh: set[int]) -> list[Stream]:
        """The streams whose clients still wait; the others end before any work is spent on them.

        Asked only of streams about to join that waited for a row: each question is a round trip to
        the server on this thread, which every running stream's next step waits for (traced: 2-3 ms
        from a newcomer's arrival to its join on 2 busy cores), and a stream that came during the
        last step (``fresh``: ids) is rarely cancelled already; if it was, the outbox's check after
        its first tokens ends it (``CANCEL_CHECK_EVERY``)."""
        keep, gone = [], []
        for s in streams:
            asked = s.cancelled is not None and id(s) not in fresh
            (gone if asked and s.cancelled() else keep).append(s)
        if gone:
            with self.lock:
                self.queued -= len(gone)
            for s in gone:
                s.done = True
                if self.on_cancelled is not None:
                    self.on_cancelled(s)
        return keep

    def _report(self) -> None:
        if self.report_passes is not None and self.batch.passes > self.reported:
            self.report_passes(self.batch.passes - self.reported)
        self.reported = self.batch.passes

    def _fail(self, streams: list[Stream], error: Exception) -> None:
        for s in streams:
            s.done = True
            self.on_error(s, error)


class TritonPythonModel:
    """Triton's entry points: initialize, execute (one call per dynamic batch), finalize."""

    def initialize(self, args: dict[str, Any]) -> None:
        here = os.path.join(args["model_repository"], args["model_version"])
        kind = args.get("model_instance_kind", "CPU")
        device = f"cuda:{args.get('model_instance_device_id', 0)}" if kind == "GPU" else "cpu"
        torch.set_num_threads(max(1, int(os.environ.get("LLMPIPE_SERVE_THREADS", torch.get_num_threads()))))
        # a batch's prompts are tokenized in one call: on tokenizers' own thread pool that call took
        # 1.1 ms for 8 short prompts against 0.5 ms on this thread, and the pool's threads, spinning
        # after it, slowed the generation that followed by 2 ms (2 cores); the variable is
        # tokenizers' only switch, a deployment that sets it keeps its choice
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        limits = Limits.load(os.path.join(here, SETTINGS_FILE))
        self.gen = Generator(os.path.join(here, CHECKPOINT_DIR), limits, device)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        labels = {"model": args["model_name"], "version": str(args["model_version"])}
        # the families must outlive their metrics: they stay attributes of the model
        self.families = [
            pb_utils.MetricFamily(name=ERRORS_METRIC, description="Requests answered with an error, by reason "
                                  "(refused: invalid; failed: generation raised); Triton counts them as successes",
                                  kind=pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily(name=TOKENS_METRIC, description="New tokens generated and sent to clients",
                                  kind=pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily(name=PASSES_METRIC, description="Forward passes of the model (prefills and decode "
                                  "steps; the streaming model's running batch); tokens / passes is its mean batch",
                                  kind=pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily(name=RESPONSES_METRIC, description="Responses of the streaming model that carried "
                                  "tokens; tokens / responses above 1: sends fell behind and tokens left together",
                                  kind=pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily(name=UNSTARTED_METRIC, description="Streams whose client cancelled while they "
                                  "waited for a row: dropped before their prefill", kind=pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily(name=STREAMS_METRIC, description="The streaming model's open streams now: "
                                  "running (a row of the batch) or waiting for a row (at most deploy.max_waiting)",
                                  kind=pb_utils.MetricFamily.GAUGE),
        ]
        self.refused = self.families[0].Metric(labels={**labels, "reason": "refused"})
        self.failed = self.families[0].Metric(labels={**labels, "reason": "failed"})
        self.overloaded = self.families[0].Metric(labels={**labels, "reason": "overloaded"})
        self.tokens = self.families[1].Metric(labels=labels)
        self.passes = self.families[2].Metric(labels=labels)
        self.responses = self.families[3].Metric(labels=labels)
        self.unstarted = self.families[4].Metric(labels=labels)
        self.outbox = self.scheduler = None
        if self.decoupled:
            # three threads share this process's GIL: the generation thread runs Python most of the
            # time, and execute (new streams) and the outbox (sends) need it for moments; at
            # CPython's 5 ms switch interval each such moment could wait 5 ms, in TTFT and ITL
            sys.setswitchinterval(min(sys.getswitchinterval(), STREAM_SWITCH_INTERVAL_S))
            self.outbox = Outbox(self._send_failed, _answer, self._before_send,
                                 linger_s=limits.stream_linger_ms / 1000)
            self.running = self.families[5].Metric(labels={**labels, "state": "running"})
            self.waiting = self.families[5].Metric(labels={**labels, "state": "waiting"})
            max_rows = int(json.loads(args["model_config"]).get("max_batch_size") or 1)
            batch = RunningBatch(self.gen.model, self.gen.eos_ids, self.gen.pad_id, max_rows=max_rows,
                                 chunk_tokens=limits.prefill_chunk_tokens)
            self.scheduler = StreamScheduler(batch, max_rows, self._stream_failed, self.passes.increment,
                                             max_waiting=limits.max_waiting, on_cancelled=self._stream_cancelled,
                                             on_depth=self._streams_now)
        # what is loaded now (torch, transformers, the model) lives as long as the model: out of the
        # collector's sight, a full collection while serving scans only what came after (0.5 ms seen)
        # instead of all of it (160-200 ms each, measured during the model's loading)
        gc.freeze()

    def _parse_all(self, requests: list[Any]) -> list[GenRequest | str]:
        """A GenRequest per valid request, the error message for each refused one (counted)."""
        raw: list[Any] = []
        for r in requests:
            try:
                raw.append(_raw_request(r))
            except BadRequest as e:
                raw.append(e)
        checked = iter(self.gen.parse_batch([r for r in raw if not isinstance(r, BadRequest)]))
        parsed: list[GenRequest | str] = []
        for r in raw:
            p = r if isinstance(r, BadRequest) else next(checked)
            parsed.append(str(p) if isinstance(p, BadRequest) else p)
        if refused := sum(isinstance(p, str) for p in parsed):
            self.refused.increment(refused)  # once per batch: an increment is a round trip to the server
        return parsed

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if self.decoupled:
            self._execute_streaming(requests)
            return None
        parsed = self._parse_all(requests)
        good = [p for p in parsed if isinstance(p, GenRequest)]
        try:
            generated = self.gen.generate(good) if good else []
        except Exception as e:  # noqa: BLE001 - report to every client of the batch, keep serving
            self.failed.increment(len(good))
            return [pb_utils.InferenceResponse(error=_bad_request(p) if isinstance(p, str) else
                                               pb_utils.TritonError(f"generation failed: {e}")) for p in parsed]
        if generated:  # one forward pass per token of the longest answer, whatever the rows' sampling
            self.passes.increment(max(len(t) for t in generated))
        results, responses, sent = iter(generated), [], 0
        for p in parsed:
            if isinstance(p, str):
                responses.append(pb_utils.InferenceResponse(error=_bad_request(p)))
                continue
            tokens = next(results)
            sent += len(tokens)
            responses.append(_answer(self.gen.decode(tokens), tokens))
        if sent:
            self.tokens.increment(sent)  # once per batch: each increment is a round trip to the server
        return responses

    def _execute_streaming(self, requests: list[Any]) -> None:
        """Decoupled: each request's response sender gets one response per new token, the last one
        with the FINAL flag; refused requests get their error as their one final response. The valid
        ones go to the generation thread (in-flight batching) and ``execute`` returns."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        streams = []
        for request, p in zip(requests, self._parse_all(requests), strict=True):
            sender = request.get_response_sender()
            if isinstance(p, str):
                self.outbox.put(_Sent(), sender, pb_utils.InferenceResponse(error=_bad_request(p)), final)
            else:
                streams.append(self._stream(p, sender))
        refused = self.scheduler.submit(streams) if streams else []
        for stream in refused:  # the waiting list is full: refused at once, not queued out of Triton's sight
            stream.done = True
            self.outbox.put(stream.owner, stream.owner.sender, pb_utils.InferenceResponse(error=_overloaded(
                f"overloaded: {self.scheduler.max_waiting} streams already wait for a row of the running batch "
                f"(deploy.max_waiting); retry later")), final)
        if refused:
            self.overloaded.increment(len(refused))

    def _streams_now(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def _stream_cancelled(self, stream: Stream) -> None:
        """Its client cancelled while it waited: closed, never prefilled (counted)."""
        self.unstarted.increment(1)
        self.outbox.put(stream.owner, stream.owner.sender, None, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _stream(self, request: GenRequest, sender: Any) -> Stream:
        """A stream whose tokens go to ``sender`` as text deltas; it stops when its client cancels."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        deltas, sent = TextDeltas(self.gen.decode, self.gen.tokenizer), _Sent(sender)

        def on_token(token: int, last: bool) -> bool:
            if sent.broken:  # a send failed (counted then): generate nothing more for it
                return True
            if sent.cancelled:  # the outbox learnt that the client went away: close, send nothing more
                self.outbox.put(sent, sender, None, final)
                return True
            sent.tokens += 1
            self.outbox.put(sent, sender, Tokens(deltas.add(token, last), [token]), final if last else 0)
            return False

        return Stream(request, on_token, owner=sent, cancelled=sender.is_cancelled)

    def _before_send(self, sent: _Sent, tokens: bool, flags: int) -> None:
        """The outbox's hook, on its thread, just before each send of a stream: what asks the server
        here (a round trip each, ~0.25 ms of waiting, measured under load) is kept off the generation
        thread, where it stalled every stream's next step.

        With the stream's final send its tokens and its responses with tokens are added to the metrics
        (once per stream, before it leaves: a client holding its last token reads them counted);
        before a send of tokens, once per ``CANCEL_CHECK_EVERY`` of its tokens, it asks whether the
        client cancelled (the stream's next token then ends it: ``sent.cancelled``)."""
        sent.responses += tokens
        if flags & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            if sent.tokens:
                self.tokens.increment(sent.tokens)
            if sent.responses:
                self.responses.increment(sent.responses)
        elif tokens and sent.tokens >= sent.asked + CANCEL_CHECK_EVERY:
            sent.asked = sent.tokens
            sent.cancelled = bool(sent.sender.is_cancelled())

    def _stream_failed(self, stream: Stream, error: Exception) -> None:
        """Generation raised: the stream's error as its final response, counted as failed."""
        sent = stream.owner
        self.failed.increment(1)
        self.outbox.put(sent, sent.sender, pb_utils.InferenceResponse(
            error=pb_utils.TritonError(f"generation failed: {error}")), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _send_failed(self, sent: _Sent) -> None:
        self.failed.increment(1)

    def finalize(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()  # open streams get their error first, then the outbox sends what is left
        if self.outbox is not None:
            self.outbox.close()
        self.gen = None
        # the metrics go before their families
        self.refused = self.failed = self.overloaded = self.tokens = self.passes = self.responses = None
        self.unstarted = None
        self.families = []
