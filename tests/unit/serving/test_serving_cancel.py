"""Cancelling a stream stops its generation (the running batch drops a cancelled row:
``test_serving_inflight.py``). On a real Triton server a gRPC client cancels a long stream after
its first token: the streaming model stops generating for it (seen in the server's own token and forward-pass counters, not
the client) and another client's stream, concurrent or later, still gets the full, correct answer."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient

from llmpipe.serving import server as srv
from llmpipe.serving.client import TextClient
from llmpipe.serving.config import DeployConfig
from llmpipe.serving.monitoring import metric_sum, read_metrics
from llmpipe.serving.repository import write_model_repository
from llmpipe.serving.triton_model import PASSES_METRIC, TOKENS_METRIC

needs_triton = pytest.mark.skipif(not srv.available(), reason="no Triton binary: run scripts/install.sh")
MODEL, STREAM = "cancel_lm", "cancel_lm_stream"
LIMIT = 256  # max_tokens_limit: the long stream asks for all of it
PROMPTS = ["the quick brown fox", "once upon a time", "héllo wörld, numbers 12345", "a b c d e f"]


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[srv.TritonServer]:
    cfg = DeployConfig(model_name=MODEL, max_prompt_tokens=48, max_tokens_limit=LIMIT, max_queue_delay_us=2000)
    repo = tmp_path_factory.mktemp("repo")
    write_model_repository(tiny_checkpoint, repo, cfg, 1)
    with srv.serve(repo) as s:
        yield s


@pytest.fixture(scope="module")
def long_prompt(server: srv.TritonServer) -> str:
    """A prompt the tiny random model answers with all LIMIT tokens (no early end-of-sequence)."""
    with TextClient(server.grpc_url, MODEL, "grpc") as c:
        prompt = next((p for p in PROMPTS if len(c.generate(prompt=p, max_tokens=LIMIT).output_ids) == LIMIT), None)
    assert prompt is not None, f"no prompt ran to {LIMIT} tokens"
    return prompt


def _tokens(server: srv.TritonServer) -> float:
    return metric_sum(read_metrics(server.metrics_url), TOKENS_METRIC, model=STREAM)


def _passes(server: srv.TritonServer) -> float:
    """The stream model's forward passes, once the counter has settled (its generation thread adds
    the passes when it goes idle, a moment after the last response)."""
    url = server.metrics_url
    last, deadline = None, time.monotonic() + 60
    while (now := metric_sum(read_metrics(url), PASSES_METRIC, model=STREAM)) != last:
        assert time.monotonic() < deadline, "the forward-pass counter did not settle"
        last = now
        time.sleep(0.3)
    return now


def _cancel_after_first_token(server: srv.TritonServer, prompt: str) -> int:
    """Start a LIMIT-token stream, cancel it once its first response arrives; the tokens the client got."""
    got: queue.Queue[Any] = queue.Queue()
    with TextClient(server.grpc_url, STREAM, "grpc") as c:
        inputs = c.prepare(prompt=prompt, max_tokens=LIMIT)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer(STREAM, inputs, request_id="cancelled")
        result, error = got.get(timeout=60)
        assert error is None, error
        received = result.as_numpy("output_ids").size  # one token, or a few when the sends fell behind
        assert received >= 1
        client.stop_stream(cancel_requests=True)  # tritonclient's public cancellation: cancels what is pending
    finally:
        client.close()
    while not got.empty():
        result, error = got.get()
        received += 0 if result is None else result.as_numpy("output_ids").size
    return received


@pytest.mark.slow
@needs_triton
def test_a_cancelled_stream_stops_generating(server: srv.TritonServer, long_prompt: str) -> None:
    passes0, tokens0 = _passes(server), _tokens(server)
    with TextClient(server.grpc_url, STREAM, "grpc") as c:  # the same request, read to its end
        full = [t for ch in c.stream(prompt=long_prompt, max_tokens=LIMIT) for t in ch.output_ids]
    assert len(full) == LIMIT
    passes1, tokens1 = _passes(server), _tokens(server)
    assert tokens1 - tokens0 == LIMIT and passes1 - passes0 == LIMIT  # alone: one pass per token
    received = _cancel_after_first_token(server, long_prompt)
    passes2 = _passes(server)
    generated = _tokens(server) - tokens1
    # the server, not the client, says it stopped: far fewer tokens sent and forward passes run than asked for
    assert received <= generated < LIMIT / 4, (received, generated)
    assert passes2 - passes1 < LIMIT / 4, ("forward passes of the cancelled stream", passes2 - passes1)


@pytest.mark.slow
@needs_triton
def test_other_streams_complete_while_and_after_one_is_cancelled(server: srv.TritonServer,
                                                                 long_prompt: str) -> None:
    with TextClient(server.grpc_url, MODEL, "grpc") as batch:
        want = {p: batch.generate(prompt=p, max_tokens=64).output_ids for p in PROMPTS}
    got: dict[str, list[int]] = {}

    def other(prompt: str) -> None:
        with TextClient(server.grpc_url, STREAM, "grpc") as c:
            got[prompt] = [t for ch in c.stream(prompt=prompt, max_tokens=64) for t in ch.output_ids]

    for _ in range(3):  # concurrent streams, some batched with the cancelled one
        threads = [threading.Thread(target=other, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        _cancel_after_first_token(server, long_prompt)
        for t in threads:
            t.join(timeout=120)
        assert got == want
        got.clear()
    other(PROMPTS[0])  # and a later one
    assert got[PROMPTS[0]] == want[PROMPTS[0]]
