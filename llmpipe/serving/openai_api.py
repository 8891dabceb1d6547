"""An OpenAI-compatible HTTP API in front of a Triton deployment: one engine, many front ends (vLLM's shape).

``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (the tokenizer's chat template
applied), streamed as server-sent events (``stream: true``, ending ``data: [DONE]``) or answered
whole, with ``usage`` and ``finish_reason`` (``stop``: end-of-text or a ``stop`` string; ``length``:
``max_tokens`` reached); ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``, ``seed``
and ``n`` (n requests to the engine). Errors are OpenAI's error objects
(``{"error": {"message", "type", "param", "code"}}``): 400 for a bad request or a prompt over the
context length (the limit named), 401 for a wrong API key, 404 for an unknown model, 429 when the
engine's queue (or this front end's in-flight bound) is full, 503 when the engine is not ready, 504
when it does not answer within ``timeout_s``.
``/health`` answers 200 when the engine's models are ready *and generate*: loaded models whose every
generation fails must not look healthy, and Triton 2.51's Python backend has no way for a model to
report itself not ready. So the front end remembers the last generation's outcome (a client's
request, or its own probe) and, when that is older than ``health_cache_s``, probes a 1-token greedy
generation on each model (batch and streaming); a failure (HTTP 500 from the engine) turns ``/health``
503 with the engine's message, the next success turns it 200 again. A probe refused as overloaded
(429) counts as alive: a busy replica is not a broken one. ``/metrics`` is Prometheus text, with
streamed answers' time to first token and inter-token latency (the gaps between an answer's chunks),
which deployments/monitoring/alerts.yml watches.

Why a front end and not Triton's own LLM convention (``text_input`` / ``text_output`` BYTES tensors
with ``sampling_parameters``): the Python backend stub of the Triton 2.51 build we ship (the
``nvidia-pytriton`` wheel) is built against numpy 1; under the numpy 2 our stack needs, it crashes
deserialising ``BYTES`` inputs and ``as_numpy`` repeats the first element of multi-element tensors.
So text travels inside as UTF-8 ``UINT8`` tensors read through DLPack (see ``triton_model.py``), and
those private tensors stay behind this API: clients speak OpenAI's protocol only.

The front end tokenizes (it counts ``usage.prompt_tokens``, checks the context length and applies
the chat template with the deployment's own tokenizer) and sends token ids over gRPC to the streaming
model (in-flight batching: a request joins the running batch at the next decode step and leaves it at
its own last token), whole answers too, gathered here; whole answers go to the batch model (dynamic
batching) only where its response cache is on or there is no streaming model. A
sampled request without a ``seed`` gets a random one, so Triton's response cache, whose key is the
request's inputs, never replays a sampled answer; the same seed gives the same answer.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import Request  # at module level: FastAPI resolves the endpoints' (string) annotations here
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)
DEFAULT_API_PORT = 8080
MAX_N = 8  # choices per request: each is a request to the engine
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)
# Bucket bounds (seconds) of the streamed requests' latency histograms. The p99 objectives that
# deployments/monitoring/alerts.yml alerts on (TTFT 200 ms, inter-token 100 ms) are bounds with near
# neighbours on both sides, so histogram_quantile resolves them rather than interpolating across a
# wide bucket (tests/test_manifests.py holds the two together).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5, 1.0, 2.5, 5.0, 10.0)
ITL_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.125, 0.15, 0.2, 0.3,
               0.5, 1.0, 2.5)


class ApiError(Exception):
    """An OpenAI error object with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def not_ready(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable", code="model_not_ready")


def overloaded(message: str) -> ApiError:
    return ApiError(429, message, "rate_limit_exceeded", code="overloaded")


# -- what the front end knows of the deployment ---------------------------------------------------------
@dataclass
class ApiConfig:
    """Where the engine is and what it serves; :func:`api_config` reads it from a model repository."""

    triton_grpc: str  # host:port of Triton's gRPC endpoint
    model: str  # the batch model (whole answers)
    stream_model: str | None  # the streaming model (None: streams are answered in one piece)
    checkpoint: Path  # the served checkpoint: tokenizer, chat template, context length, end-of-text ids
    max_prompt_tokens: int = 512
    max_tokens_limit: int = 256
    default_max_tokens: int = 16
    served_name: str | None = None  # the model id clients name (default: ``model``)
    api_key: str | None = None  # when set, every /v1 request needs ``Authorization: Bearer <key>``
    max_in_flight: int = 256  # requests this front end holds at once; more get 429
    timeout_s: float = 300.0
    health_cache_s: float = 2.0  # /health trusts a generation outcome this recent; older: it probes
    probe_timeout_s: float = 30.0  # how long /health's 1-token probe may take
    response_cache: bool = False  # the batch model caches answers: whole answers go to it (else to the stream model)

    @property
    def name(self) -> str:
        return self.served_name or self.model


def api_config(repo: str | Path, triton_grpc: str, **kw: Any) -> ApiConfig:
    """The front end's config for a model repository (or deploy artifact) served at ``triton_grpc``."""
    from llmpipe.serving.repository import REPO_DIR, model_config_summary
    from llmpipe.serving.triton_model import CHECKPOINT_DIR, SETTINGS_FILE

    repo = Path(repo)
    if (repo / REPO_DIR).is_dir():
        repo = repo / REPO_DIR
    summary = model_config_summary(repo)
    vdir = repo / summary["model"] / str(summary["version"])
    settings = vdir / SETTINGS_FILE
    limits = json.loads(settings.read_text()) if settings.is_file() else {}
    keys = ("max_prompt_tokens", "max_tokens_limit", "default_max_tokens")
    kw.setdefault("response_cache", bool(summary["response_cache"]))
    return ApiConfig(triton_grpc=triton_grpc, model=summary["model"], stream_model=summary["stream_model"],
                     checkpoint=vdir / CHECKPOINT_DIR, **{k: int(limits[k]) for k in keys if k in limits}, **kw)


# -- requests ----------------------------------------------------------------------------------------------
class _Request(BaseModel):
    """What both endpoints take; fields OpenAI has and we do not serve are refused when set (below)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # vLLM's extension; 0 (and OpenAI's absence of it): no cut
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


# fields of OpenAI's API we do not serve: refused when they ask for something, ignored at their default
UNSERVED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
            "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
            "frequency_penalty": (None, 0, 0.0), "tools": (None, []), "tool_choice": (None, "none"),
            "response_format": (None, {"type": "text"})}


def _refuse_unserved(req: _Request) -> None:
    for name, value in (req.model_extra or {}).items():
        if name in UNSERVED and value not in UNSERVED[name]:
            raise ApiError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")


def _validation_error(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or None
    return ApiError(400, f"{param or 'request'}: {err.get('msg', 'invalid')}", param=param)


@dataclass
class Job:
    """One request to the engine: a prompt's ids and how to pick its tokens."""

    ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None


@dataclass
class Answer:
    """One choice's result: its text, its token count, why it ended."""

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None


class StopScan:
    """Text cut at the first ``stop`` string: ``feed`` returns what is safe to send now, holding back a
    tail that may be the start of a stop string; ``stopped`` once one was seen."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held, self.stopped = [s for s in stops if s], "", False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self.held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[:min(hits)]
        keep = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep] if keep else text

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped else held


# -- the engine: Triton over gRPC ---------------------------------------------------------------------------
class TritonEngine:
    """Whole answers from the batch model, streams from the streaming model, over one gRPC channel."""

    def __init__(self, cfg: ApiConfig, eos: set[int], probe_ids: list[int] | None = None) -> None:
        import tritonclient.grpc.aio as grpcclient

        self.cfg, self.mod, self.eos = cfg, grpcclient, eos
        self.client = grpcclient.InferenceServerClient(cfg.triton_grpc)
        self.probe_ids = probe_ids or [0]
        self.last: tuple[float, bool, str] | None = None  # (monotonic time, generated?, error) of the last outcome
        self.probe_lock = asyncio.Lock()  # one probe at a time, however many health checks wait

    def _record(self, ok: bool, error: str = "") -> None:
        self.last = (time.monotonic(), ok, error)

    def _outcome(self, e: ApiError) -> ApiError:
        """Record a failed generation (HTTP 500: the model raised); a refusal says nothing of its health."""
        if e.status == 500:
            self._record(False, e.message)
        return e

    async def health(self) -> tuple[bool, str]:
        """(ready, why not): the models are loaded and the last generation, or a fresh probe, succeeded."""
        if not await self.ready():
            return False, "the model server's models are not ready"
        async with self.probe_lock:
            last = self.last
            if last is not None and time.monotonic() - last[0] < self.cfg.health_cache_s:
                return last[1], last[2]
            return await self.probe()

    async def probe(self) -> tuple[bool, str]:
        """A 1-token greedy generation on the batch model and on the streaming model."""
        # greedy under a seed of its own: the response cache (its key: the inputs) never answers a probe
        job = Job(self.probe_ids, 1, 0.0, 1.0, 0, secrets.randbits(62))
        try:
            await self.complete(job, self.cfg.probe_timeout_s, fresh=True)
            if self.cfg.stream_model is not None:
                pieces = self.stream(job, self.cfg.probe_timeout_s)
                try:
                    await pieces.__anext__()
                finally:
                    await pieces.aclose()  # type: ignore[attr-defined]
        except ApiError as e:
            if e.status == 429:  # busy, not broken
                return True, ""
            return False, e.message
        except StopAsyncIteration:
            self._record(False, "the streaming model ended the probe without a token")
            return False, "the streaming model ended the probe without a token"
        return True, ""

    async def close(self) -> None:
        await self.client.close()

    async def ready(self) -> bool:
        try:
            models = [self.cfg.model, *([self.cfg.stream_model] if self.cfg.stream_model else [])]
            return all([await self.client.is_model_ready(m) for m in models])
        except Exception:  # noqa: BLE001 - unreachable or refusing: not ready
            return False

    def _inputs(self, job: Job) -> list[Any]:
        def tensor(name: str, value: np.ndarray, dtype: str) -> Any:
            t = self.mod.InferInput(name, list(value.shape), dtype)
            t.set_data_from_numpy(value)
            return t

        # every request sends the same inputs (a greedy one seed 0): Triton's dynamic batcher batches only
        # requests with the same set of inputs, and greedy and sampled requests are to share a batch
        return [tensor("input_ids", np.asarray([job.ids], dtype=np.int64), "INT64"),
                tensor("max_tokens", np.asarray([[job.max_tokens]], dtype=np.int32), "INT32"),
                tensor("temperature", np.asarray([[job.temperature]], dtype=np.float32), "FP32"),
                tensor("top_p", np.asarray([[job.top_p]], dtype=np.float32), "FP32"),
                tensor("top_k", np.asarray([[job.top_k]], dtype=np.int32), "INT32"),
                tensor("seed", np.asarray([[job.seed or 0]], dtype=np.int64), "INT64")]

    async def complete(self, job: Job, timeout_s: float | None = None, fresh: bool = False) -> tuple[list[int], str]:
        """The batch model's answer; ``fresh``: the job's seed is new to the response cache."""
        from tritonclient.utils import InferenceServerException

        try:
            res = await self.client.infer(self.cfg.model, self._inputs(job), client_timeout=timeout_s or self.cfg.timeout_s)
        except InferenceServerException as e:
            raise self._outcome(engine_error(e)) from None
        ids, text = res.as_numpy("output_ids"), res.as_numpy("text")
        if ids is None or text is None:  # Triton 2.51's response cache replays an error as an empty answer
            if job.temperature == 0 and not fresh:
                # a greedy answer does not depend on the seed, which is part of the cache key: asking
                # again under another seed generates (a generation that failed once is not replayed
                # as failed for good) or says why the request is refused
                return await self.complete(replace(job, seed=secrets.randbits(62)), timeout_s, fresh=True)
            raise ApiError(400, "the engine answered without outputs (a cached refusal); fix the request")
        self._record(True)
        return [int(x) for x in ids.reshape(-1)], text.tobytes().decode("utf-8", errors="replace")

    async def answer(self, job: Job) -> tuple[list[int], str]:
        """A whole answer (a request without ``stream``): from the streaming model's running batch, where
        a request leaves at its own last token (in-flight batching), gathered here; from the batch model
        where there is no streaming model or the batch model's response cache is on (Triton caches only
        one-response models). In a dynamic batch a 1-token request waits for the batch's longest answer."""
        if self.cfg.stream_model is None or self.cfg.response_cache:
            return await self.complete(job)
        ids: list[int] = []
        texts: list[str] = []
        async for new, text in self.stream(job):
            ids += new
            texts.append(text)
        return ids, "".join(texts)

    async def stream(self, job: Job, timeout_s: float | None = None) -> AsyncIterator[tuple[list[int], str]]:
        """(new ids, their text) as the streaming model sends them; ends after ``max_tokens`` tokens or an
        end-of-text id (``eos``), or with the model's error. Closing the iterator cancels the request."""
        import grpc
        from tritonclient.utils import InferenceServerException

        if self.cfg.stream_model is None:  # no streaming model: the whole answer as one piece
            yield await self.complete(job)
            return

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": self.cfg.stream_model, "inputs": self._inputs(job)}

        responses = self.client.stream_infer(requests(), stream_timeout=timeout_s or self.cfg.timeout_s)
        got = 0
        try:
            async for result, error in responses:
                if error is not None:
                    raise self._outcome(engine_error(error))
                if got == 0:
                    self._record(True)
                ids = result.as_numpy("output_ids")
                text = result.as_numpy("text")
                new = [] if ids is None else [int(x) for x in ids.reshape(-1)]
                got += len(new)
                yield new, "" if text is None else text.tobytes().decode("utf-8", errors="replace")
                if got >= job.max_tokens or (new and new[-1] in self.eos):
                    return
        except (InferenceServerException, grpc.RpcError) as e:  # the stream's own call fails as a gRPC error
            raise self._outcome(engine_error(e)) from None
        finally:
            responses.cancel()  # done or abandoned (a stop string, a client gone): the model stops too


def engine_error(e: Exception) -> ApiError:
    """The API error for an error of the engine: its status where gRPC gives one, else its words."""
    if callable(getattr(e, "code", None)):  # a gRPC error
        status, msg = str(e.code()), str(e.details())  # type: ignore[attr-defined]
    else:  # tritonclient's
        status, msg = str(getattr(e, "status", lambda: "")() or ""), str(getattr(e, "message", lambda: e)() or e)
    if "overloaded" in msg:
        return overloaded(msg)
    if "Exceeds maximum queue size" in msg:  # Triton's dynamic batcher, at deploy.max_waiting queued requests
        return overloaded(f"overloaded: the model's queue is full (deploy.max_waiting); retry later ({msg})")
    if "DEADLINE_EXCEEDED" in status or "Deadline Exceeded" in msg:
        return ApiError(504, f"the model server did not answer in time ({msg})", "timeout", code="timeout")
    if "UNAVAILABLE" in status or "failed to connect" in msg or "not ready" in msg or "unknown model" in msg:
        return not_ready(f"the model server is not ready: {msg}")
    if "generation failed" in msg or "INTERNAL" in status:
        return ApiError(500, msg, "server_error")
    return ApiError(400, msg)


# -- the app -----------------------------------------------------------------------------------------------
@dataclass
class Metrics:
    """The front end's Prometheus metrics, in a registry of its own."""

    registry: Any = None
    requests: Any = None
    tokens: Any = None
    latency: Any = None
    ttft: Any = None
    in_flight: Any = None
    itl: Any = None

    @classmethod
    def create(cls) -> Metrics:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        reg = CollectorRegistry()
        return cls(reg, Counter("llmpipe_api_requests", "OpenAI API requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=reg),
                   Counter("llmpipe_api_tokens", "Tokens of answered requests (kind: prompt, completion)",
                           ["kind"], registry=reg),
                   Histogram("llmpipe_api_request_seconds", "Request duration until the answer (or the stream) "
                             "ended", ["endpoint"], registry=reg),
                   Histogram("llmpipe_api_time_to_first_token_seconds", "Streamed requests: until the first "
                             "token was sent", ["endpoint", "model"], registry=reg, buckets=TTFT_BUCKETS),
                   Gauge("llmpipe_api_requests_in_flight", "Requests holding one of the front end's max_in_flight "
                         "slots now", registry=reg),
                   Histogram("llmpipe_api_inter_token_latency_seconds", "Streamed requests: the gap between two "
                             "consecutive chunks of one answer", ["model"], registry=reg, buckets=ITL_BUCKETS))


@dataclass
class State:
    cfg: ApiConfig
    tokenizer: Any
    context: int | None
    eos: set[int]
    metrics: Metrics
    engine: TritonEngine | None = None
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def load_state(cfg: ApiConfig) -> State:
    """The tokenizer, context length and end-of-text ids of the served checkpoint."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(cfg.checkpoint)
    context = getattr(AutoConfig.from_pretrained(cfg.checkpoint), "max_position_embeddings", None)
    try:
        eos = GenerationConfig.from_pretrained(cfg.checkpoint).eos_token_id
    except OSError:
        eos = tok.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    return State(cfg, tok, int(context) if context else None, eos_ids, Metrics.create())


def create_app(cfg: ApiConfig, state: State | None = None) -> Any:
    """The FastAPI app of the front end (served by :func:`serve_api`, or by any ASGI server)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse

    st = state or load_state(cfg)

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        probe = [int(i) for i in st.tokenizer("Hello", add_special_tokens=True)["input_ids"]]
        st.engine = TritonEngine(cfg, st.eos, probe)
        try:
            yield
        finally:
            await st.engine.close()

    app = FastAPI(title="llmpipe OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    app.add_middleware(_RequestCounter, counter=st.metrics.requests)

    def _auth(request: Request) -> None:
        if cfg.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {cfg.api_key}".encode()):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    @app.get("/health")
    async def health() -> Any:
        ready, why = (False, "starting") if st.engine is None else await st.engine.health()
        return JSONResponse({"ready": ready, **({} if ready else {"reason": why})}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Any:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(st.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        _auth(request)
        return {"object": "list", "data": [{"id": cfg.name, "object": "model", "created": 0, "owned_by": "llmpipe",
                                            "max_model_len": st.context}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        _auth(request)
        req = _parse(CompletionRequest, await _json(request))
        prompts = _prompts(st, req.prompt)
        return await _serve(st, req, prompts, "text_completion", EventStream)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        _auth(request)
        req = _parse(ChatCompletionRequest, await _json(request))
        if req.max_completion_tokens is not None:
            req.max_tokens = req.max_completion_tokens
        return await _serve(st, req, [_chat_ids(st, req.messages)], "chat.completion", EventStream)

    return app


class _RequestCounter:
    """Counts /v1 requests by path and status: plain ASGI, which sees a response's status as it starts.

    Not ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` relays a streamed body chunk by
    chunk through a stream and a task of its own, a task switch more per event of every stream on the
    event loop that serves them all.
    """

    def __init__(self, app: Any, counter: Any) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


async def _json(request: Any) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise ApiError(400, f"the request body is not JSON: {e}") from None


def _parse(kind: type[_Request], body: Any) -> Any:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        req = kind.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    _refuse_unserved(req)
    return req


def _prompts(st: State, prompt: Any) -> list[list[int]]:
    """Each prompt's ids: a string, a list of strings, a list of ids, or a list of lists of ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "'prompt' is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            if not p.strip():
                raise ApiError(400, "'prompt' is empty", param="prompt")
            out.append(list(st.tokenizer(p, add_special_tokens=True)["input_ids"]))
        else:
            vocab = len(st.tokenizer)
            if not p or any(not 0 <= t < vocab for t in p):
                raise ApiError(400, f"'prompt' token ids must be a non-empty list in [0, {vocab})", param="prompt")
            out.append(list(p))
    return out


def _chat_ids(st: State, messages: list[dict[str, Any]]) -> list[int]:
    """The conversation rendered by the tokenizer's chat template (with the assistant's turn opened)."""
    if not getattr(st.tokenizer, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template, so /v1/chat/completions cannot render "
                       "messages; use /v1/completions with a prompt", param="messages", code="no_chat_template")
    plain = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param=f"messages.{i}")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise ApiError(400, f"messages[{i}] needs a 'role' and a text 'content'", param=f"messages.{i}")
        plain.append({"role": m["role"], "content": content})
    text = st.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    ids = list(st.tokenizer(text, add_special_tokens=False)["input_ids"])
    # what the model sees (usage.prompt_tokens counts these ids): at DEBUG, for checking a template
    log.debug("chat prompt (%d tokens, the chat template's rendering): %r", len(ids), text)
    return ids


def _jobs(st: State, req: _Request, prompts: list[list[int]], chat: bool) -> list[Job]:
    """n jobs per prompt, within the limits and the context; a random seed for sampled ones without one."""
    cfg = st.cfg
    if req.model != cfg.name:
        raise ApiError(404, f"the model '{req.model}' does not exist: this server serves '{cfg.name}'",
                       param="model", code="model_not_found")
    if req.max_tokens is not None and req.max_tokens > cfg.max_tokens_limit:
        raise ApiError(400, f"'max_tokens' is {req.max_tokens}, over this deployment's limit of "
                       f"{cfg.max_tokens_limit}", param="max_tokens")
    jobs = []
    for ids in prompts:
        if len(ids) > cfg.max_prompt_tokens:
            raise ApiError(400, f"the prompt has {len(ids)} tokens, over this deployment's limit of "
                           f"{cfg.max_prompt_tokens} prompt tokens", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        room = cfg.max_tokens_limit if st.context is None else min(cfg.max_tokens_limit, st.context - len(ids))
        n = req.max_tokens if req.max_tokens is not None else min(cfg.max_tokens_limit if chat else
                                                                 cfg.default_max_tokens, room)
        if st.context is not None and len(ids) + n > st.context:
            raise ApiError(400, f"this model's maximum context length is {st.context} tokens, but {len(ids) + n} "
                           f"were requested ({len(ids)} in the prompt, {n} in the completion); shorten the prompt "
                           "or lower max_tokens", param="max_tokens", code="context_length_exceeded")
        if n < 1:
            raise ApiError(400, f"the prompt ({len(ids)} tokens) leaves no room in this model's context of "
                           f"{st.context} tokens", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        for k in range(req.n):
            seed = None
            if req.temperature > 0:
                seed = secrets.randbits(62) if req.seed is None else (req.seed + k) % 2**63
            jobs.append(Job(ids, n, req.temperature, req.top_p, req.top_k, seed))
    return jobs


def _stops(req: _Request) -> list[str]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    return stops


class _Slot:
    """One request's place among the front end's in-flight requests (429 when there is none)."""

    def __init__(self, st: State) -> None:
        self.st, self.held = st, False

    def __enter__(self) -> _Slot:
        with self.st.lock:
            if self.st.in_flight >= self.st.cfg.max_in_flight:
                raise overloaded(f"overloaded: {self.st.in_flight} requests in flight, this server's limit "
                                 f"(max_in_flight {self.st.cfg.max_in_flight}); retry later")
            self.st.in_flight += 1
            self.st.metrics.in_flight.set(self.st.in_flight)
            self.held = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        with self.st.lock:
            if self.held:
                self.st.in_flight -= 1
                self.st.metrics.in_flight.set(self.st.in_flight)
                self.held = False


def _finish(tokens: list[int], job: Job, eos: set[int], stopped: bool) -> str:
    if stopped or len(tokens) < job.max_tokens or (tokens and tokens[-1] in eos):
        return "stop"
    return "length"


async def _serve(st: State, req: _Request, prompts: list[list[int]], kind: str, streaming_response: Any) -> Any:
    """The answer (or the event stream) of one request; its slot among the in-flight requests is held
    until the answer is complete or the stream ends."""
    chat = kind == "chat.completion"
    jobs = _jobs(st, req, prompts, chat)
    stops = _stops(req)
    assert st.engine is not None
    slot = _Slot(st).__enter__()
    t0 = time.perf_counter()
    endpoint = "chat" if chat else "completions"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    try:
        if not req.stream:
            answers = await asyncio.gather(*(_whole(st, job, stops) for job in jobs))
            st.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
            return _body(st, req, rid, created, kind, jobs, answers)
        # the first response of every choice before the 200: a refusal (429, 400) is an HTTP status
        streams = [_Choice(i, job, st.engine.stream(job), StopScan(stops), st.eos) for i, job in enumerate(jobs)]
        try:  # one choice (the common request) awaited here: gather's task is a turn of the loop more
            await (streams[0].prime() if len(streams) == 1 else asyncio.gather(*(c.prime() for c in streams)))
        except BaseException:
            await asyncio.gather(*(c.close() for c in streams), return_exceptions=True)
            raise
    except BaseException:
        slot.release()
        raise
    events = _events(st, req, rid, created, kind, streams, slot, t0, endpoint)
    # the events up to the first piece of text: a role chunk per choice first in a chat
    lead = (len(streams) if chat else 0) + 1
    return streaming_response(events, lead=lead, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _whole(st: State, job: Job, stops: list[str]) -> tuple[Answer, list[int]]:
    assert st.engine is not None
    ids, text = await st.engine.answer(job)
    scan = StopScan(stops)
    cut = scan.feed(text) + scan.flush()
    return Answer(cut, len(ids), _finish(ids, job, st.eos, scan.stopped)), ids


def _prompt_tokens(req: _Request, jobs: list[Job]) -> int:
    """The prompts' tokens, each prompt once (its n choices share it)."""
    return sum(len(j.ids) for j in jobs[::req.n])


def _body(st: State, req: _Request, rid: str, created: int, kind: str, jobs: list[Job],
          answers: list[tuple[Answer, list[int]]]) -> dict[str, Any]:
    completion = sum(a.tokens for a, _ in answers)
    prompt = _prompt_tokens(req, jobs)
    st.metrics.tokens.labels("prompt").inc(prompt)
    st.metrics.tokens.labels("completion").inc(completion)
    if kind == "chat.completion":
        choices = [{"index": i, "message": {"role": "assistant", "content": a.text}, "logprobs": None,
                    "finish_reason": a.finish_reason} for i, (a, _) in enumerate(answers)]
    else:
        choices = [{"index": i, "text": a.text, "logprobs": None, "finish_reason": a.finish_reason}
                   for i, (a, _) in enumerate(answers)]
    return {"id": rid, "object": kind, "created": created, "model": st.cfg.name, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


class EventStream(StreamingResponse):
    """Starlette's streamed response whose headers and first ``lead`` events are sent by the task that
    calls it (the request's), before Starlette's task group starts the rest.

    Starlette streams from a task it starts beside the one that listens for the client's disconnect;
    that task runs only after everything already waiting on the event loop (the other streams'
    engine responses and events), so the first token, in hand when the handler returns, waited a
    turn of a busy loop before it left (traced through the server: 7 ms median from the engine's
    first response to its event at 8 streams on 2 busy cores). The rest of the stream, and the
    disconnect listener (a client gone while the lead was sent is seen at once after it), are
    Starlette's."""

    def __init__(self, content: AsyncIterator[str], lead: int = 1, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.lead, self.started = lead, False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not self.started:
            self.started = True
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            for _ in range(self.lead):
                try:
                    event = await self.body_iterator.__anext__()
                except StopAsyncIteration:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                await send({"type": "http.response.body", "body": event.encode(self.charset), "more_body": True})
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Any) -> None:
        if not self.started:  # not through __call__'s lead (a websocket scope): all of it, as Starlette does
            await super().stream_response(send)
            return
        async for event in self.body_iterator:
            await send({"type": "http.response.body", "body": event.encode(self.charset), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Choice:
    """One streamed choice: its engine stream, its first response read ahead, its stop scan."""

    def __init__(self, index: int, job: Job, it: AsyncIterator[tuple[list[int], str]], scan: StopScan,
                 eos: set[int]) -> None:
        self.index, self.job, self.it, self.scan, self.eos = index, job, it, scan, eos
        self.first: tuple[list[int], str] | None = None
        self.tokens: list[int] = []

    async def prime(self) -> None:
        self.first = await self.it.__anext__()

    async def close(self) -> None:
        await self.it.aclose()  # type: ignore[attr-defined]

    async def pieces(self) -> AsyncIterator[str]:
        """Text to send, cut at a stop string (the engine's request is then cancelled)."""
        pending = [self.first] if self.first is not None else []
        try:
            while True:
                item = pending.pop() if pending else await self.it.__anext__()
                ids, text = item
                self.tokens += ids
                out = self.scan.feed(text)
                if out:
                    yield out
                if self.scan.stopped:
                    return
        except StopAsyncIteration:
            tail = self.scan.flush()
            if tail:
                yield tail
        finally:
            await self.close()

    @property
    def finish_reason(self) -> str:
        return _finish(self.tokens, self.job, self.eos, self.scan.stopped)


async def _events(st: State, req: _Request, rid: str, created: int, kind: str, streams: list[_Choice],
                  slot: _Slot, t0: float, endpoint: str) -> AsyncIterator[str]:
    """Server-sent events: each choice's pieces as they come, its finish_reason, usage if asked, [DONE]."""
    chat = kind == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, text: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        body = {"id": rid, "object": obj, "created": created, "model": st.cfg.name, "choices": [choice]}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    tasks: list[asyncio.Future[None]] = []

    async def merged() -> AsyncIterator[tuple[int, str | None, BaseException | None]]:
        """(choice, piece or None at its end, error) as the choices' pieces come. One choice (the common
        request) is read here, on the writer's task: a queue and a task between them cost a task
        switch per token."""
        if len(streams) == 1:
            try:
                async for piece in streams[0].pieces():
                    yield 0, piece, None
                yield 0, None, None
            except Exception as e:  # noqa: BLE001 - reported to the client by the writer
                yield 0, None, e
            return
        queue: asyncio.Queue[tuple[int, str | None, BaseException | None]] = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            try:
                async for piece in c.pieces():
                    await queue.put((c.index, piece, None))
                await queue.put((c.index, None, None))
            except BaseException as e:  # noqa: BLE001 - handed to the writer, which reports it
                await queue.put((c.index, None, e))

        tasks.extend(asyncio.ensure_future(pump(c)) for c in streams)
        while True:
            yield await queue.get()

    open_ = len(streams)
    first_sent = False
    last_sent: dict[int, float] = {}  # choice -> when its last chunk was sent
    pieces = merged()
    try:
        if chat:
            for c in streams:
                yield chunk(c.index, "", None, first=True)
        while open_:
            index, piece, error = await pieces.__anext__()
            if error is not None:
                err = error if isinstance(error, ApiError) else ApiError(500, f"generation failed: {error}",
                                                                            "server_error")
                yield f"data: {json.dumps(err.body())}\n\n"
                break
            if piece is None:
                open_ -= 1
                yield chunk(index, None, streams[index].finish_reason)
                continue
            now = time.perf_counter()
            if not first_sent:
                st.metrics.ttft.labels(endpoint, st.cfg.name).observe(now - t0)
                first_sent = True
            if index in last_sent:  # the gap a reader of this answer waited since its previous chunk
                st.metrics.itl.labels(st.cfg.name).observe(now - last_sent[index])
            last_sent[index] = now
            yield chunk(index, piece, None)
        completion = sum(len(c.tokens) for c in streams)
        prompt = _prompt_tokens(req, [c.job for c in streams])
        st.metrics.tokens.labels("prompt").inc(prompt)
        st.metrics.tokens.labels("completion").inc(completion)
        if (req.stream_options or {}).get("include_usage"):
            usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
            body = {"id": rid, "object": obj, "created": created, "model": st.cfg.name, "choices": [], "usage": usage}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await pieces.aclose()  # type: ignore[attr-defined]
        if len(streams) == 1:
            await streams[0].close()  # its pieces ended, or were never asked for: the engine's stream closes
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        st.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
        slot.release()


# -- running it -----------------------------------------------------------------------------------------------
@dataclass
class ApiServer:
    """A running front end: where to reach it."""

    host: str
    port: int

    @property
    def url(self) -> str:
        """The base URL OpenAI clients take (``openai.OpenAI(base_url=...)``)."""
        return f"http://{self.host}:{self.port}/v1"


class ApiPortBusy(OSError):
    """The API's port is taken by another process (the message names it)."""


def listen_socket(host: str) -> Any:
    """An unbound TCP socket for the API on ``host``, its protocol named (``IPPROTO_TCP``, not 0).

    asyncio turns Nagle's algorithm off (``TCP_NODELAY``) only on connections whose socket says it is
    TCP; accepted from a socket made with protocol 0 they kept Nagle on, so each streamed event after
    the first waited for the client's delayed ACK: the first token reached a client 40 ms after it left
    the engine and the next ones arrived bunched behind it (seen on every streamed request).
    """
    import socket

    return socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)


@contextmanager
def serve_api(cfg: ApiConfig, host: str = "127.0.0.1", port: int = 0,
              startup_timeout_s: float = 60.0) -> Iterator[ApiServer]:
    """Serve the front end on ``host:port`` (127.0.0.1 unless told; port 0 picks a free one) from a thread
    of this process until the block exits: no process of its own to leave behind."""
    import uvicorn

    app = create_app(cfg)
    sock = listen_socket(host)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno != errno.EADDRINUSE:
            raise
        raise ApiPortBusy(f"the OpenAI API could not start: its port {host}:{port} is in use by another process "
                          f"({e.strerror or e})") from None
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="llmpipe-openai-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"the OpenAI API did not start on {host}:{sock.getsockname()[1]}")
        time.sleep(0.02)
    try:
        yield ApiServer(host, sock.getsockname()[1])
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
