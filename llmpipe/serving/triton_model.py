"""Triton Python-backend model for text generation; the deploy stage copies this file to ``<model>/<v>/model.py``.

It is self-contained (torch + transformers only, no llmpipe import) so the same file runs in NVIDIA's
Triton image. The same file serves two models of the repository: the batch model (one response per
request) and, where its config.pbtxt says ``model_transaction_policy { decoupled: true }``, the
streaming model (one response per generated token, the last one flagged final). Why the tensors
look the way they do:

* Text travels as UTF-8 bytes in ``UINT8`` tensors, not ``BYTES``: with numpy 2 the Python backend
  stub of Triton 2.51 (built against numpy 1) corrupts every multi-element tensor it converts to
  numpy (``as_numpy`` repeats the first element) and crashes deserialising ``BYTES`` inputs. Every
  tensor therefore moves through DLPack (``to_dlpack`` / ``Tensor.from_dlpack``), never numpy.
* The dynamic batcher hands ``execute`` several requests at once; they are generated together as one
  left-padded batch (that is where batching pays), grouped by temperature, and each request gets
  its own response or its own error, so one bad request never fails its neighbours.
* Triton counts a request the Python backend answers with an error response as a success
  (``nv_inference_request_success``); the requests this model refuses are counted in a metric of
  its own, ``llmpipe_request_errors_total`` (reason ``refused``: invalid requests, ``failed``: a
  batch whose generation raised), which the error-rate alert adds to Triton's failures.
"""

from __future__ import annotations

import json
import os
import queue
import threading
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
CANCEL_CHECK_EVERY = 4  # a stream asks whether its client cancelled before its 1st, 5th, 9th... token

# on_token(row, token id, last): called once per new token of each request, ``last`` on its final one;
# returning True ends that row there (its client cancelled): no more tokens are generated for it
TokenCallback = Callable[[int, int, bool], bool | None]


class BadRequest(ValueError):
    """A request the model refuses, with a message meant for the client."""


@dataclass
class GenRequest:
    """One validated request."""

    input_ids: list[int]
    max_tokens: int
    temperature: float


@dataclass
class Limits:
    """Request bounds; written by the deploy stage into ``llmpipe_serving.json``."""

    max_prompt_tokens: int = 512
    max_tokens_limit: int = 256
    default_max_tokens: int = 16

    @classmethod
    def load(cls, path: str) -> Limits:
        if not os.path.exists(path):
            return cls()
        with open(path) as f:
            data = json.load(f)
        return cls(**{k: int(data[k]) for k in ("max_prompt_tokens", "max_tokens_limit",
                                                "default_max_tokens") if k in data})


def _masks(keep: torch.Tensor, steps: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive 4D attention masks for a left-padded batch: the prompt's (causal, pads hidden) and one
    for all decode steps (slice ``[..., :length]``), built once per batch.

    ``forward`` takes a prepared 4D mask as is (transformers' documented custom-mask input), so no step
    rebuilds the mask from the 2D padding mask (a fifth of a padded batch's decode time at hidden 64).
    A pad position attends to itself only: no query row is fully masked (NaN), and
    no real token ever attends to a pad.
    """
    n, width = keep.shape
    low = torch.finfo(dtype).min
    eye = torch.eye(width, dtype=torch.bool, device=keep.device)
    causal = torch.ones(width, width, dtype=torch.bool, device=keep.device).tril()
    allowed = (causal[None] & keep[:, None, :]) | eye[None]
    prompt = torch.zeros((n, 1, width, width), dtype=dtype, device=keep.device).masked_fill(~allowed[:, None], low)
    full = torch.cat([keep, keep.new_ones((n, steps))], dim=1)
    step = torch.zeros((n, 1, 1, width + steps), dtype=dtype, device=keep.device).masked_fill(~full[:, None, None], low)
    return prompt, step


def _pick(logits: torch.Tensor, temperature: float, rng: torch.Generator | None) -> torch.Tensor:
    """Next token per row: argmax, or a sample of softmax(logits / temperature) (no top-k / top-p)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=rng).reshape(-1)


@torch.inference_mode()
def decode_batch(model: Any, ids: torch.Tensor, keep: torch.Tensor, budgets: list[int], eos_ids: set[int],
                 temperature: float = 0.0, on_token: TokenCallback | None = None,
                 rng: torch.Generator | None = None) -> list[list[int]]:
    """Greedy or sampled decoding of a left-padded batch with the model's own forward and a KV cache.

    The loop ``generate`` runs, without its per-call and per-step machinery (logits processors,
    stopping criteria, streamer, mask rebuild), which adds about a third to a tiny model's forward
    passes; 16 tokens for 8 requests then take about 1.25 times what they take for one. Greedy output
    equals ``model.generate`` greedy output (a test pins it). ``keep`` marks real tokens (False on the
    left padding). Row ``i`` gets at most ``budgets[i]`` tokens and stops after an end-of-sequence
    token; ``on_token(row, token, last)`` sees each new token as soon as it is picked and ends the row
    when it returns True (a cancelled stream); the loop ends when every row is done.
    """
    from transformers import DynamicCache

    n, width = ids.shape
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
        picked = _pick(logits, temperature, rng)
        for row, tok in enumerate(picked.tolist()):
            if not live[row]:
                continue
            out[row].append(tok)
            last = len(out[row]) >= budgets[row] or tok in eos_ids
            live[row] = not last
            if on_token is not None and on_token(row, tok, last):
                live[row] = False
        if not any(live):
            break
        length += 1
        x, pos = picked[:, None], pos[:, -1:] + 1
        mask = None if step_mask is None else step_mask[..., :length]
    return out


class Generator:
    """Batched greedy / sampled generation with per-request validation."""

    def __init__(self, checkpoint: str, limits: Limits, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint).to(device).eval()
        self.device = device
        self.limits = limits
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self.pad_id = int(pad)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))

    # -- validation -------------------------------------------------------------------------------
    def parse(self, prompt: bytes | None, input_ids: list[int] | None, max_tokens: int | None,
              temperature: float | None) -> GenRequest:
        """Turn raw inputs into a GenRequest or raise BadRequest saying exactly what is wrong."""
        if (prompt is None) == (input_ids is None):
            raise BadRequest("send exactly one of 'prompt' (UTF-8 bytes as UINT8) or 'input_ids' (INT64)")
        if prompt is not None:
            try:
                text = prompt.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadRequest(f"'prompt' is not valid UTF-8: {e}") from None
            if not text.strip():
                raise BadRequest("'prompt' is empty")
            ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        else:
            ids = list(input_ids or [])
            if not ids:
                raise BadRequest("'input_ids' is empty")
            bad = [t for t in ids if t < 0 or t >= self.vocab_size]
            if bad:
                raise BadRequest(f"'input_ids' has ids outside [0, {self.vocab_size}): {bad[:5]}")
        if len(ids) > self.limits.max_prompt_tokens:
            raise BadRequest(f"prompt has {len(ids)} tokens, over the limit of {self.limits.max_prompt_tokens}")
        n = self.limits.default_max_tokens if max_tokens is None else int(max_tokens)
        if not 1 <= n <= self.limits.max_tokens_limit:
            raise BadRequest(f"'max_tokens' must be in [1, {self.limits.max_tokens_limit}], got {n}")
        t = 0.0 if temperature is None else float(temperature)
        if not (t >= 0.0 and t <= 10.0):  # also rejects NaN
            raise BadRequest(f"'temperature' must be in [0, 10], got {t}")
        return GenRequest(ids, n, t)

    # -- generation -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, reqs: list[GenRequest], on_token: TokenCallback | None = None) -> list[list[int]]:
        """New token ids per request; requests with the same temperature share one padded batch.

        With ``on_token`` every new token is also handed on as soon as it is generated (streaming);
        ``row`` is the request's index in ``reqs``.
        """
        out: list[list[int]] = [[] for _ in reqs]
        groups: dict[float, list[int]] = {}
        for i, r in enumerate(reqs):
            groups.setdefault(r.temperature, []).append(i)
        for temp, idx in groups.items():
            cb = None if on_token is None else _reindex(on_token, idx)
            for i, ids in zip(idx, self._generate_group([reqs[i] for i in idx], temp, cb), strict=True):
                out[i] = ids
        return out

    def _generate_group(self, reqs: list[GenRequest], temperature: float,
                        on_token: TokenCallback | None) -> list[list[int]]:
        width = max(len(r.input_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        keep = torch.zeros((len(reqs), width), dtype=torch.bool)
        for row, r in enumerate(reqs):  # left padding: every prompt ends at the same position
            ids[row, width - len(r.input_ids):] = torch.tensor(r.input_ids, dtype=torch.long)
            keep[row, width - len(r.input_ids):] = True
        return decode_batch(self.model, ids.to(self.device), keep.to(self.device), [r.max_tokens for r in reqs],
                            self.eos_ids, temperature, on_token)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def _reindex(on_token: TokenCallback, idx: list[int]) -> TokenCallback:
    """A group's row numbers mapped back to the request's index in the whole batch."""
    return lambda row, tok, last: on_token(idx[row], tok, last)  # passes a stop (True) on


class TextDeltas:
    """The text each new token adds, so the concatenated pieces equal the decoded answer.

    A byte-level token can end inside a multi-byte character; its text is held back (decoded as
    U+FFFD) until the token that completes it arrives, and the final piece flushes what is left.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, token: int, last: bool) -> str:
        self.tokens.append(token)
        text = self.decode(self.tokens)
        if not last and text.endswith("\ufffd"):
            return ""
        piece = text[len(self.sent):] if text.startswith(self.sent) else text
        self.sent = text
        return piece


# -- the Triton side -----------------------------------------------------------------------------
def _tensor(request: Any, name: str) -> torch.Tensor | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else torch.from_dlpack(t.to_dlpack())


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


def _answer(text: str, tokens: list[int]) -> Any:
    raw = text.encode("utf-8")
    return pb_utils.InferenceResponse(output_tensors=[
        _out("text", torch.tensor(list(raw), dtype=torch.uint8).reshape(1, -1)),
        _out("output_ids", torch.tensor(tokens, dtype=torch.long).reshape(1, -1)),
    ])


class Outbox:
    """Sends a streaming batch's responses from a thread of its own, in the order they were put.

    A send is a round trip to the Triton server process (it waits while the server takes the
    response); with 8 streams a step's 8 sends took several times the tiny model's forward pass. On
    this thread they overlap the next step's forward instead of adding to it (sending from another
    thread is how Triton's decoupled examples answer): ITL p50 at 8 clients 4.0 instead of 6.2-6.6 ms
    in one run. ``drain`` waits until everything put so far is sent and returns the senders that failed.
    """

    def __init__(self) -> None:
        self.queue: queue.Queue[tuple[Any, Any, int]] = queue.Queue()
        self.failed: set[int] = set()  # id() of the senders whose send raised
        self.thread = threading.Thread(target=self._run, name="llmpipe-outbox", daemon=True)
        self.thread.start()

    def put(self, sender: Any, response: Any, flags: int) -> None:
        self.queue.put((sender, response, flags))

    def _run(self) -> None:
        while True:
            sender, response, flags = self.queue.get()
            try:
                if sender is None:
                    return
                if id(sender) in self.failed:
                    continue
                if response is None:
                    sender.send(flags=flags)
                else:
                    sender.send(response, flags=flags)
            except Exception:  # noqa: BLE001 - its stream is broken; the others go on
                self.failed.add(id(sender))
            finally:
                self.queue.task_done()

    def drain(self) -> set[int]:
        self.queue.join()
        failed, self.failed = self.failed, set()
        return failed

    def close(self) -> None:
        self.queue.put((None, None, 0))
        self.thread.join(timeout=10)


class TritonPythonModel:
    """Triton's entry points: initialize, execute (one call per dynamic batch), finalize."""

    def initialize(self, args: dict[str, Any]) -> None:
        here = os.path.join(args["model_repository"], args["model_version"])
        kind = args.get("model_instance_kind", "CPU")
        device = f"cuda:{args.get('model_instance_device_id', 0)}" if kind == "GPU" else "cpu"
        torch.set_num_threads(max(1, int(os.environ.get("LLMPIPE_SERVE_THREADS", torch.get_num_threads()))))
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
        ]
        self.refused = self.families[0].Metric(labels={**labels, "reason": "refused"})
        self.failed = self.families[0].Metric(labels={**labels, "reason": "failed"})
        self.tokens = self.families[1].Metric(labels=labels)
        self.outbox = Outbox() if self.decoupled else None

    def _parse(self, request: Any) -> GenRequest:
        prompt = _tensor(request, "prompt")
        ids = _tensor(request, "input_ids")
        return self.gen.parse(
            None if prompt is None else bytes(prompt.reshape(-1).to(torch.uint8).tolist()),
            None if ids is None else [int(x) for x in ids.reshape(-1).tolist()],
            None if (v := _scalar(_tensor(request, "max_tokens"), "max_tokens")) is None else int(v),
            _scalar(_tensor(request, "temperature"), "temperature"),
        )

    def _parse_all(self, requests: list[Any]) -> list[GenRequest | str]:
        """A GenRequest per valid request, the error message for each refused one (counted)."""
        parsed: list[GenRequest | str] = []
        for r in requests:
            try:
                parsed.append(self._parse(r))
            except BadRequest as e:
                parsed.append(str(e))
                self.refused.increment(1)
        return parsed

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if self.decoupled:
            self._execute_streaming(requests)
            return None
        parsed = self._parse_all(requests)
        good = [p for p in parsed if isinstance(p, GenRequest)]
        try:
            results = iter(self.gen.generate(good)) if good else iter(())
        except Exception as e:  # noqa: BLE001 - report to every client of the batch, keep serving
            self.failed.increment(len(good))
            return [pb_utils.InferenceResponse(error=_bad_request(p) if isinstance(p, str) else
                                               pb_utils.TritonError(f"generation failed: {e}")) for p in parsed]
        responses, sent = [], 0
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
        with the FINAL flag; refused requests get their error as their one final response."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        senders = [r.get_response_sender() for r in requests]
        out = self.outbox
        parsed = self._parse_all(requests)
        live = [i for i, p in enumerate(parsed) if isinstance(p, GenRequest)]
        for i, p in enumerate(parsed):
            if isinstance(p, str):
                out.put(senders[i], pb_utils.InferenceResponse(error=_bad_request(p)), final)
        deltas = [TextDeltas(self.gen.decode) for _ in live]
        done = [False] * len(live)
        sent = [0] * len(live)

        def on_token(row: int, token: int, last: bool) -> bool:
            if done[row]:  # closed (cancelled by its client)
                return True
            sender = senders[live[row]]
            done[row] = last
            # asking costs a round trip to the server, like a send: every CANCEL_CHECK_EVERY tokens
            if sent[row] % CANCEL_CHECK_EVERY == 0 and sender.is_cancelled():
                done[row] = True  # the client went away: close its stream, send nothing more
                out.put(sender, None, final)
                return True  # and stop generating for it: a batch of cancelled streams ends here
            sent[row] += 1
            out.put(sender, _answer(deltas[row].add(token, last), [token]), final if last else 0)
            return False

        try:
            if live:
                self.gen.generate([parsed[i] for i in live], on_token)  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - report to every open stream of the batch, keep serving
            for row in (r for r, d in enumerate(done) if not d):
                out.put(senders[live[row]], pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"generation failed: {e}")), final)
                done[row] = True
                self.failed.increment(1)
        for row in (r for r, d in enumerate(done) if not d):  # ended without a last token: close it
            out.put(senders[live[row]], None, final)
        broken = out.drain()  # every response of this batch is sent before the next batch starts
        if broken:
            self.failed.increment(len(broken))
        if any(sent):
            self.tokens.increment(sum(sent))  # once per batch: an increment is a round trip too

    def finalize(self) -> None:
        if self.outbox is not None:
            self.outbox.close()
        self.gen = None
        self.refused = self.failed = self.tokens = None  # metrics before their families
        self.families = []
