"""A real Triton server with the batch model and its streaming (decoupled) model: tokens read as they
arrive over gRPC streaming and HTTP generate_stream, the streaming load test's figures, the response
cache and the refused-request counter seen in Triton's metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from llmpipe.serving import server as srv
from llmpipe.serving.client import TextClient
from llmpipe.serving.config import DeployConfig
from llmpipe.serving.loadtest import SloViolation, percentile, stream_load_test
from llmpipe.serving.monitoring import metric_sum, read_metrics
from llmpipe.serving.repository import write_model_repository
from llmpipe.serving.triton_model import ERRORS_METRIC, RESPONSES_METRIC, TOKENS_METRIC

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not srv.available(), reason="no Triton binary: run scripts/install.sh")]
MODEL, STREAM = "tiny_lm", "tiny_lm_stream"
PROMPTS = ["the quick brown fox", "héllo wörld, numbers 12345", "once upon a time"]


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[srv.TritonServer]:
    # token by token (no linger): these tests watch each token leave; deploy.stream_linger_ms's sends are
    # test_serving_outbox's, and the OpenAI API's tests run with its default
    cfg = DeployConfig(model_name=MODEL, max_prompt_tokens=48, max_tokens_limit=64, max_queue_delay_us=2000,
                       response_cache=True, stream_linger_ms=0)
    repo = tmp_path_factory.mktemp("repo")
    write_model_repository(tiny_checkpoint, repo, cfg, 1)
    with srv.serve(repo) as s:
        yield s


def _url(server: srv.TritonServer, protocol: str) -> str:
    return server.http_url if protocol == "http" else server.grpc_url


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_streamed_tokens_concatenate_to_the_batch_answer(server: srv.TritonServer, protocol: str) -> None:
    with TextClient(_url(server, protocol), MODEL, protocol) as batch, \
            TextClient(_url(server, protocol), STREAM, protocol) as stream:
        for prompt in PROMPTS:
            want = batch.generate(prompt=prompt, max_tokens=24)
            every = list(stream.stream(prompt=prompt, max_tokens=24))
            assert [c.final for c in every] == [False] * (len(every) - 1) + [True]
            chunks = [c for c in every if c.output_ids]  # over HTTP the final one is empty: the stream's end
            assert len(every) - len(chunks) == (protocol == "http")  # a chunk: a token, or a few sent together
            assert [t for c in chunks for t in c.output_ids] == want.output_ids
            assert "".join(c.text for c in chunks) == want.text
        ids = [7, 150, 33, 201]  # by token ids too
        assert [t for c in stream.stream(input_ids=ids, max_tokens=6) for t in c.output_ids] == \
            batch.generate(input_ids=ids, max_tokens=6).output_ids


def test_the_server_counts_the_responses_and_tokens_a_client_reads(server: srv.TritonServer) -> None:
    def counted() -> tuple[float, float]:
        found = read_metrics(server.metrics_url)
        return metric_sum(found, RESPONSES_METRIC, model=STREAM), metric_sum(found, TOKENS_METRIC, model=STREAM)

    responses0, tokens0 = counted()
    chunks = tokens = 0
    with TextClient(server.grpc_url, STREAM, "grpc") as c:
        for prompt in PROMPTS * 2:
            got = [ch for ch in c.stream(prompt=prompt, max_tokens=24) if ch.output_ids]
            chunks, tokens = chunks + len(got), tokens + sum(len(ch.output_ids) for ch in got)
    responses1, tokens1 = counted()  # counted before each stream's final send: settled once it is read
    assert (responses1 - responses0, tokens1 - tokens0) == (chunks, tokens)
    assert chunks <= tokens  # tokens / responses: above 1 where sends fell behind


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_first_token_arrives_long_before_a_64_token_answer_ends(server: srv.TritonServer, protocol: str) -> None:
    with TextClient(_url(server, protocol), STREAM, protocol) as c:
        prompt = next((p for p in PROMPTS if sum(len(ch.output_ids) for ch in c.stream(prompt=p, max_tokens=64)) == 64),
                      None)
        assert prompt is not None, "no prompt ran to 64 tokens"  # the tiny random model may end early
        tries = []
        for _ in range(3):  # on a busy 2-core machine the server can deliver a burst late: best of three
            sent = time.perf_counter()
            chunks = [ch for ch in c.stream(prompt=prompt, max_tokens=64) if ch.output_ids]
            ttft, e2e = chunks[0].arrived - sent, chunks[-1].arrived - sent
            spread = int((np.diff([ch.arrived for ch in chunks]) > 0).sum())
            tries.append((round(ttft * 1000, 2), round(e2e * 1000, 2), spread))
            if ttft < e2e / 5 and spread > 48:  # tokens arrive one after another, not in one final burst
                return
    pytest.fail(f"TTFT not well under e2e in 3 tries (ttft ms, e2e ms, distinct arrivals): {tries}")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_refused_requests_get_their_reason_and_are_counted(server: srv.TritonServer, protocol: str) -> None:
    metrics = server.metrics_url
    before = read_metrics(metrics)
    with TextClient(_url(server, protocol), STREAM, protocol) as c:
        with pytest.raises(InferenceServerException, match="'prompt' is empty"):
            list(c.stream(prompt=" ", max_tokens=4))
        with pytest.raises(InferenceServerException, match=r"'max_tokens' must be in \[1, 64\], got 99"):
            list(c.stream(prompt="hi", max_tokens=99))
        assert len(list(c.stream(prompt="the lazy dog", max_tokens=3))) >= 1  # the stream keeps serving
    with TextClient(_url(server, protocol), MODEL, protocol) as c:  # a prompt of its own: see the cache test
        with pytest.raises(InferenceServerException, match="'prompt' is empty"):
            c.generate(prompt=" " * (2 if protocol == "http" else 3), max_tokens=4)

    def delta(name: str, model: str, **labels: str) -> float:
        return metric_sum(after, name, model=model, **labels) - metric_sum(before, name, model=model, **labels)

    deadline = time.monotonic() + 10  # Triton records a request's statistics just after answering it
    while True:
        after = read_metrics(metrics)
        if delta("nv_inference_request_success", MODEL) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    assert delta(ERRORS_METRIC, STREAM, reason="refused") == 2 and delta(ERRORS_METRIC, MODEL, reason="refused") == 1
    assert delta(ERRORS_METRIC, STREAM, reason="failed") == 0
    # why our counter exists: Triton counts the refused request of the batch model as a success
    assert delta("nv_inference_request_failure", MODEL) == 0
    assert delta("nv_inference_request_success", MODEL) == 1


def test_response_cache_serves_a_repeated_request_and_not_a_different_one(server: srv.TritonServer) -> None:
    metrics = server.metrics_url

    def counts() -> tuple[float, float]:
        m = read_metrics(metrics)
        return (metric_sum(m, "nv_cache_num_hits_per_model", model=MODEL),
                metric_sum(m, "nv_cache_num_misses_per_model", model=MODEL))

    with TextClient(server.grpc_url, MODEL, "grpc") as c:
        hits0, miss0 = counts()
        first = c.generate(prompt="a cached question", max_tokens=8)
        assert counts() == (hits0, miss0 + 1)
        assert c.generate(prompt="a cached question", max_tokens=8) == first
        assert c.generate(prompt="a cached question", max_tokens=8) == first
        assert counts() == (hits0 + 2, miss0 + 1)
        c.generate(prompt="a cached question", max_tokens=7)  # another request: a miss
        c.generate(prompt="another question", max_tokens=8)
        assert counts() == (hits0 + 2, miss0 + 3)


def test_cache_replays_a_refused_request_as_an_empty_answer_the_client_refuses(server: srv.TritonServer) -> None:
    # Triton 2.51 caches the model's error response and answers the same request again from the cache
    # as a success without outputs: TextClient turns that into a clear error instead of a crash
    with TextClient(server.http_url, MODEL, "http") as c:
        with pytest.raises(InferenceServerException, match="'prompt' is empty"):
            c.generate(prompt="    ", max_tokens=5)
        with pytest.raises(InferenceServerException, match="answered without outputs: with the response cache"):
            c.generate(prompt="    ", max_tokens=5)


def test_stream_load_test_figures_agree_with_the_tests_own_clock(server: srv.TritonServer) -> None:
    for concurrency in (1, 4):
        marks: dict[int, list[float]] = {}
        tokens: dict[int, int] = {}

        def on_event(i: int, kind: str, n: int, marks: dict[int, list[float]] = marks,
                     tokens: dict[int, int] = tokens) -> None:
            marks.setdefault(i, []).append(time.perf_counter())  # "sent" first, then one per "chunk"
            tokens[i] = tokens.get(i, 0) + n  # a chunk carries one token, or a few the server sent together

        # HTTP: the client stamps a chunk's arrival in the thread that reads the stream and calls the hook
        r = stream_load_test(server.http_url, STREAM, protocol="http", concurrency=(concurrency,), requests=16,
                             max_tokens=16, on_event=on_event)
        lv = r["levels"][0]
        assert lv["concurrency"] == concurrency and lv["requests"] == 16 and lv["errors"] == 0
        assert lv["output_tokens"] == sum(tokens.values())
        ttft = [(m[1] - m[0]) * 1000 for m in marks.values()]
        e2e = [(m[-1] - m[0]) * 1000 for m in marks.values()]
        itl = [(m[-1] - m[1]) * 1000 / (tokens[i] - 1) for i, m in marks.items() if tokens[i] > 1]
        # medians: on a busy machine one late thread switch between the two clocks moves a tail quantile
        for name, mine in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
            assert lv[f"{name}_p50_ms"] == pytest.approx(percentile(mine, 50), rel=0.10), (name, concurrency)
        assert lv["output_tokens_per_s"] > 0 and lv["requests_per_s"] > 0
        assert lv["ttft_p50_ms"] <= lv["ttft_p90_ms"] <= lv["ttft_p99_ms"]


def test_stream_load_test_checks_the_slo_figure(server: srv.TritonServer) -> None:
    r = stream_load_test(server.http_url, STREAM, protocol="http", concurrency=(1, 2), requests=4, max_tokens=4,
                         slo_figure="ttft", slo_p99_ms=60_000)
    assert r["slo_ok"] and [lv["concurrency"] for lv in r["levels"]] == [1, 2]
    assert r["worst_p99_ms"] == max(lv["ttft_p99_ms"] for lv in r["levels"])
    with pytest.raises(SloViolation, match="p99 itl .* > deploy.slo_p99_ms 0.001 ms at concurrency 1"):
        stream_load_test(server.grpc_url, STREAM, concurrency=(1,), requests=2, max_tokens=4, slo_figure="itl",
                         slo_p99_ms=0.001)
    with pytest.raises(ValueError, match="slo_figure must be one of"):
        stream_load_test(server.grpc_url, STREAM, slo_figure="p99")
