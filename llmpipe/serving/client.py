"""A small text-generation client over tritonclient HTTP or gRPC, speaking the deployed model's tensors.

Text goes as UTF-8 bytes in UINT8 tensors (see llmpipe/serving/triton_model.py for why). Besides the
one-answer ``generate``, ``stream`` reads a streaming (decoupled) model's tokens as they arrive: over
gRPC through tritonclient's bidirectional stream, over HTTP through Triton's ``generate_stream``
endpoint (server-sent events).
"""

from __future__ import annotations

import http.client
import json
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Protocol = Literal["http", "grpc"]


@dataclass
class Generation:
    text: str
    output_ids: list[int]


@dataclass
class Chunk:
    """One streamed response: the new token ids, the text they add, and when it arrived."""

    output_ids: list[int]
    text: str
    arrived: float  # time.perf_counter() when the client read it
    final: bool


def _module(protocol: Protocol) -> Any:
    if protocol == "http":
        import tritonclient.http as mod
    elif protocol == "grpc":
        import tritonclient.grpc as mod
    else:
        raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
    return mod


def _server_error(message: str, status: str | None = None) -> Exception:
    from tritonclient.utils import InferenceServerException

    return InferenceServerException(message, status)


def _as_list(value: Any) -> list[Any]:
    """generate_stream's JSON turns a one-element tensor into a scalar and an empty one into []."""
    return list(value) if isinstance(value, list) else [value]


class TextClient:
    """One connection to one model; not thread-safe (the load test gives each worker its own)."""

    def __init__(self, url: str, model: str, protocol: Protocol = "http", timeout_s: float = 60.0) -> None:
        self.mod = _module(protocol)
        self.protocol = protocol
        self.model = model
        self.url = url
        kw: dict[str, Any] = {"network_timeout": timeout_s, "connection_timeout": timeout_s} \
            if protocol == "http" else {}
        self.client = self.mod.InferenceServerClient(url, **kw)
        self.timeout_s = timeout_s
        self._responses: queue.Queue[tuple[float, Any, Any]] | None = None  # the open gRPC stream's
        self._request_seq = 0
        self._outputs = [self.mod.InferRequestedOutput(n) for n in ("text", "output_ids")]

    def close(self) -> None:
        if self._responses is not None:
            self.client.stop_stream()
            self._responses = None
        self.client.close()

    def __enter__(self) -> TextClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tensor(self, name: str, array: np.ndarray, dtype: str) -> Any:
        """A raw input tensor (the tests use it to send wrong dtypes and shapes on purpose)."""
        t = self.mod.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    def infer(self, inputs: list[Any]) -> Any:
        return self.client.infer(self.model, inputs, outputs=self._outputs)

    def prepare(self, prompt: str | None = None, input_ids: list[int] | None = None, max_tokens: int = 16,
                temperature: float = 0.0, seed: int | None = None) -> list[Any]:
        """One request's input tensors, to send as often as needed (``generate(prepared=...)``,
        ``stream(prepared=...)``): a load test repeats its requests, and building the tensors anew
        each time costs the client, on the server's cores, as much CPU as sending them."""
        return self._inputs(prompt, input_ids, max_tokens, temperature, seed)

    def _inputs(self, prompt: str | None, input_ids: list[int] | None, max_tokens: int,
                temperature: float, seed: int | None = None) -> list[Any]:
        inputs = []
        if prompt is not None:
            raw = np.frombuffer(prompt.encode("utf-8"), dtype=np.uint8).reshape(1, -1)
            inputs.append(self.tensor("prompt", raw, "UINT8"))
        if input_ids is not None:
            inputs.append(self.tensor("input_ids", np.asarray([input_ids], dtype=np.int64), "INT64"))
        inputs.append(self.tensor("max_tokens", np.asarray([[max_tokens]], dtype=np.int32), "INT32"))
        inputs.append(self.tensor("temperature", np.asarray([[temperature]], dtype=np.float32), "FP32"))
        if seed is not None:  # a sampled request's own generator (and, with the response cache, its key)
            inputs.append(self.tensor("seed", np.asarray([[seed]], dtype=np.int64), "INT64"))
        return inputs

    def generate(self, prompt: str | None = None, input_ids: list[int] | None = None, max_tokens: int = 16,
                 temperature: float = 0.0, prepared: list[Any] | None = None, seed: int | None = None) -> Generation:
        """Generate from a prompt or token ids (or a ``prepare``d request); raises tritonclient's
        InferenceServerException on errors."""
        res = self.infer(prepared if prepared is not None else
                         self._inputs(prompt, input_ids, max_tokens, temperature, seed))
        text, ids = res.as_numpy("text"), res.as_numpy("output_ids")
        if text is None or ids is None:  # Triton 2.51's response cache keeps a refused request's error
            raise _server_error(f"{self.model} answered without outputs: with the response cache on, Triton "
                                "replays a refused request's cached error as an empty answer; fix the request",
                                "400")
        return Generation(text.tobytes().decode("utf-8"), [int(x) for x in ids.reshape(-1)])

    # -- streaming ----------------------------------------------------------------------------------
    def stream(self, prompt: str | None = None, input_ids: list[int] | None = None, max_tokens: int = 16,
               temperature: float = 0.0, prepared: list[Any] | None = None) -> Iterator[Chunk]:
        """The answer of a streaming model, one Chunk per response as it arrives (a new token, or a
        few when the server's sends fell behind); the last is ``final``
        (over HTTP an empty one: server-sent events mark no last response, the stream just ends).

        Raises InferenceServerException when the server refuses the request or fails mid-stream.
        Read the iterator to its end before the next request on this client.
        """
        if self.protocol == "grpc":
            return self._stream_grpc(prepared if prepared is not None else
                                     self._inputs(prompt, input_ids, max_tokens, temperature))
        if prepared is not None:
            raise ValueError("stream(prepared=...) is for gRPC: over HTTP a request is a JSON body")
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature}
        if prompt is not None:  # UINT8 bytes as a JSON array: generate_stream makes strings BYTES
            body["prompt"] = list(prompt.encode("utf-8"))
        if input_ids is not None:
            body["input_ids"] = list(input_ids)
        return self._stream_http(body)

    def connect(self) -> None:
        """Open the connection now (one liveness round trip) rather than at the first request: a load
        test's clients connect before its clock starts."""
        if not self.client.is_server_live():
            raise _server_error(f"{self.url}: the server is not live")

    def open_stream(self) -> None:
        """Open this client's gRPC bidirectional stream now; :meth:`stream` opens it on first use."""
        if self.protocol != "grpc":
            raise ValueError("open_stream is for gRPC: over HTTP each stream is a request of its own")
        if self._responses is None:  # one bidirectional stream per client
            responses: queue.Queue[tuple[float, Any, Any]] = queue.Queue()
            self.client.start_stream(
                callback=lambda result, error: responses.put((time.perf_counter(), result, error)))
            self._responses = responses

    def _stream_grpc(self, inputs: list[Any]) -> Iterator[Chunk]:
        self.open_stream()
        assert self._responses is not None
        self._request_seq += 1
        self.client.async_stream_infer(self.model, inputs, outputs=self._outputs, request_id=str(self._request_seq),
                                       enable_empty_final_response=True)
        while True:
            try:
                arrived, result, error = self._responses.get(timeout=self.timeout_s)
            except queue.Empty:
                raise _server_error(f"no streamed response from {self.model} within {self.timeout_s:.0f}s") from None
            if error is not None:
                raise error
            params = result.get_response().parameters
            final = bool(params["triton_final_response"].bool_param) if "triton_final_response" in params else False
            ids = result.as_numpy("output_ids")
            text = result.as_numpy("text")
            if ids is not None or final:
                yield Chunk([] if ids is None else [int(x) for x in ids.reshape(-1)],
                            "" if text is None else text.tobytes().decode("utf-8", errors="replace"),
                            arrived, final)
            if final:
                return

    def _stream_http(self, body: dict[str, Any]) -> Iterator[Chunk]:
        host, port = self.url.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=self.timeout_s)
        try:
            conn.request("POST", f"/v2/models/{self.model}/generate_stream", body=json.dumps(body),
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
            resp = conn.getresponse()
            if resp.status != 200 or "event-stream" not in (resp.getheader("Content-Type") or ""):
                raise _server_error(_error_text(resp.read()), str(resp.status))
            got = False
            for line in resp:  # each event as soon as it arrives
                if not line.startswith(b"data:"):
                    continue
                arrived = time.perf_counter()
                event = json.loads(line[5:])
                if "error" in event:
                    raise _server_error(str(event["error"]), "400")
                got = True
                ids = [int(x) for x in _as_list(event.get("output_ids", []))]
                text = bytes(int(b) for b in _as_list(event.get("text", []))).decode("utf-8", errors="replace")
                yield Chunk(ids, text, arrived, False)
            if not got:
                raise _server_error(f"{self.model}: generate_stream ended without a response")
            # SSE carries no final flag: the end of the stream is the final (empty) response
            yield Chunk([], "", time.perf_counter(), True)
        finally:
            conn.close()

    def statistics(self) -> dict[str, Any]:
        """The server's model statistics (inference and batch-size counts) as a dict."""
        if self.protocol == "grpc":
            return self.client.get_inference_statistics(self.model, as_json=True)
        return self.client.get_inference_statistics(self.model)


def _error_text(body: bytes) -> str:
    """The message of an error answer: JSON, or one server-sent event (a request refused on arrival)."""
    text = body.decode(errors="replace").strip()
    if text.startswith("data:"):
        text = text[5:].strip()
    try:
        return str(json.loads(text).get("error", text))
    except (ValueError, AttributeError):
        return text
