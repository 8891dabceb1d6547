"""The OpenAI-compatible API on a real Triton server, spoken to by the official ``openai`` client and curl;
and the requests that used to break the served model, each sent to the real server."""

from __future__ import annotations

import json
import queue
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer
from tritonclient.utils import InferenceServerException

from llmpipe.processes import free_port
from llmpipe.serving import server as srv
from llmpipe.serving.client import TextClient
from llmpipe.serving.config import DeployConfig
from llmpipe.serving.loadtest import batch_histogram
from llmpipe.serving.monitoring import metric_sum, read_metrics
from llmpipe.serving.openai_api import ApiConfig, ApiPortBusy, StopScan, api_config, listen_socket, serve_api
from llmpipe.serving.repository import write_model_repository
from llmpipe.serving.triton_model import ERRORS_METRIC, PASSES_METRIC, STREAMS_METRIC, UNSTARTED_METRIC
from tests.fixtures.tiny_checkpoint import greedy_reference

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not srv.available(), reason="no Triton binary: run scripts/install.sh")]
MODEL, STREAM = "tiny_lm", "tiny_lm_stream"
KEY = "sk-llmpipe-test"
PROMPT = "the quick brown fox"
LONG = [10 + i % 200 for i in range(500)]  # 500 prompt tokens: with 256 new ones over the 512 positions
# a plain template for a tokenizer without one (the exported tokenizer brings its own once it has one)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a chat template (its own if it has one)."""
    ckpt = tmp_path_factory.mktemp("chat") / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    if not tok.chat_template:
        tok.chat_template = TEMPLATE
        tok.save_pretrained(ckpt)
    return ckpt


@pytest.fixture(scope="module")
def triton(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[srv.TritonServer]:
    """Rows for 2 streams and 2 waiting; batches of 2 (a 100 ms window); the response cache on."""
    cfg = DeployConfig(model_name=MODEL, max_batch_size=2, preferred_batch_sizes=[2], max_waiting=2,
                       max_queue_delay_us=100_000, response_cache=True, max_prompt_tokens=512, max_tokens_limit=256)
    repo = tmp_path_factory.mktemp("repo")
    write_model_repository(checkpoint, repo, cfg, 1)
    with srv.serve(repo) as s:
        yield s


@pytest.fixture(scope="module")
def api(triton: srv.TritonServer) -> Iterator[str]:
    with serve_api(api_config(triton.repo, triton.grpc_url, api_key=KEY)) as a:
        yield a.url


@pytest.fixture(scope="module")
def client(api: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api, api_key=KEY, max_retries=0, timeout=120)




def test_greedy_completion_is_the_models_answer(client: openai.OpenAI, checkpoint: Path) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    tok = AutoTokenizer.from_pretrained(checkpoint)
    ids = tok(PROMPT)["input_ids"]
    want = greedy_reference(checkpoint, ids, 12)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    assert r.usage.total_tokens == len(ids) + len(want)
    assert r.choices[0].finish_reason == ("stop" if len(want) < 12 or want[-1] == tok.eos_token_id else "length")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)  # token ids too
    assert by_ids.choices[0].text == r.choices[0].text


def test_streamed_completion_adds_up_to_the_answer(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c for c in chunks if c.choices]
    assert len(texts) > 2  # token by token, not one piece
    assert "".join(c.choices[0].text for c in texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in texts][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in texts[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_chat_renders_the_messages_with_the_chat_template(client: openai.OpenAI, checkpoint: Path) -> None:
    tok = AutoTokenizer.from_pretrained(checkpoint)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    rendered = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"]
    plain = client.completions.create(model=MODEL, prompt=rendered, max_tokens=10, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == len(rendered) and chat.choices[0].finish_reason == plain.choices[0].finish_reason
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_stop_strings_cut_the_answer(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = next(whole[i:i + 2] for i in range(3, len(whole) - 1) if whole[i:i + 2].strip())  # a piece of its middle
    cut = whole[: whole.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\x00never"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_stop_scan_holds_back_what_may_start_a_stop_string() -> None:
    scan = StopScan(["END", "\n\n"])
    assert [scan.feed(p) for p in ("abc E", "N", "x", "\n", "\nEND")] == ["abc ", "", "ENx", "", ""]
    assert scan.stopped and scan.flush() == ""
    scan = StopScan(["END"])
    assert scan.feed("ab EN") == "ab " and scan.flush() == "EN"  # the end of the answer: what was held goes out


def test_curl_reads_server_sent_events(api: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True})
    out = subprocess.run(["curl", "-sS", "-N", "--max-time", "60", f"{api}/completions", "-H",
                          "Content-Type: application/json", "-H", f"Authorization: Bearer {KEY}", "-d", body],
                         capture_output=True, text=True, check=True).stdout
    events = [e for e in out.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 1
    plain = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", f"{api}/models"], capture_output=True, text=True,
                           check=True).stdout.rsplit("\n", 1)
    assert plain[1] == "401" and json.loads(plain[0])["error"]["code"] == "invalid_api_key"
    # the API's own Prometheus metrics (open, like /health): requests by endpoint and status, tokens
    from llmpipe.serving.monitoring import parse_metrics

    metrics = parse_metrics(subprocess.run(["curl", "-sS", api.replace("/v1", "/metrics")], capture_output=True,
                                           text=True, check=True).stdout)
    assert metric_sum(metrics, "llmpipe_api_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert metric_sum(metrics, "llmpipe_api_requests_total", endpoint="/v1/models", status="401") >= 1
    assert metric_sum(metrics, "llmpipe_api_tokens_total", kind="completion") >= 1
    assert metric_sum(metrics, "llmpipe_api_time_to_first_token_seconds_count", endpoint="completions") >= 1


def _error(call: object) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as e:
        call()  # type: ignore[operator]
    return e.value


def test_errors_are_openai_error_objects_with_their_status(client: openai.OpenAI, api: str) -> None:
    e = _error(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0))
    assert e.status_code == 400 and e.body["param"] == "max_tokens" and e.body["type"] == "invalid_request_error"
    e = _error(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2))
    assert e.status_code == 400 and e.body["param"] == "logprobs"
    e = _error(lambda: client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4))
    assert e.status_code == 404 and e.body["code"] == "model_not_found"
    long_prompt = LONG  # 500 tokens: within the prompt limit, not with 256 new ones
    e = _error(lambda: client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=256))
    assert e.status_code == 400 and e.body["code"] == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in e.body["message"] and "756" in e.body["message"]
    e = _error(lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x " * 600}]))
    assert e.status_code == 400 and e.body["code"] == "context_length_exceeded" and "512" in e.body["message"]
    wrong = openai.OpenAI(base_url=api, api_key="sk-wrong", max_retries=0)
    e = _error(lambda: wrong.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4))
    assert e.status_code == 401 and isinstance(e, openai.AuthenticationError)


def test_an_engine_that_is_not_up_answers_503(checkpoint: Path) -> None:
    cfg = ApiConfig(triton_grpc=f"127.0.0.1:{free_port()}", model=MODEL, stream_model=STREAM, checkpoint=checkpoint)
    with serve_api(cfg) as a:
        c = openai.OpenAI(base_url=a.url, api_key="none", max_retries=0, timeout=60)
        for stream in (False, True):
            e = _error(lambda stream=stream: c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                                                  stream=stream))
            assert e.status_code == 503 and e.body["code"] == "model_not_ready"
        health = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", a.url.replace("/v1", "/health")],
                                capture_output=True, text=True).stdout
        assert health == "503"


# -- the requests that used to break the model, each sent to the real server ----------------------------------
def _hits(triton: srv.TritonServer) -> float:
    return metric_sum(read_metrics(triton.metrics_url), "nv_cache_num_hits_per_model", model=MODEL)


def test_sampled_answers_are_never_replayed_by_the_cache(client: openai.OpenAI, triton: srv.TritonServer) -> None:
    hits = _hits(triton)
    hot = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=5.0).choices[0].text
           for _ in range(3)]
    assert len(set(hot)) == 3 and _hits(triton) == hits  # no seed: a seed of its own each, no cache hit
    seeded = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=5.0, seed=11)
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]  # the same seed, the same answer (a cache hit is then correct)
    other = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=5.0, seed=12)
    assert other.choices[0].text != seeded[0]
    n = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=5.0, n=2)
    assert len(n.choices) == 2 and n.choices[0].text != n.choices[1].text
    with TextClient(triton.grpc_url, MODEL, "grpc") as c:  # Triton directly: a sampled request must bring a seed
        with pytest.raises(InferenceServerException, match="needs a 'seed'"):
            c.generate(prompt="a fresh prompt", max_tokens=4, temperature=1.0)


def test_a_request_of_two_prompts_is_refused(triton: srv.TritonServer) -> None:
    with TextClient(triton.grpc_url, MODEL, "grpc") as c:
        two = c.tensor("input_ids", np.array([[5, 6, 7], [8, 9, 10]], dtype=np.int64), "INT64")
        mt = c.tensor("max_tokens", np.array([[4], [4]], dtype=np.int32), "INT32")
        with pytest.raises(InferenceServerException, match=r"shape \[2, 3\]: send one prompt per request"):
            c.infer([two, mt])


def test_context_overflow_is_refused_naming_the_limit(triton: srv.TritonServer) -> None:
    """Triton directly (the API refuses it before: see the errors test): both models."""
    overflow = r"prompt \(500 tokens\) \+ max_tokens \(256\) = 756 is over the model's context length of 512"
    with TextClient(triton.grpc_url, MODEL, "grpc") as c, pytest.raises(InferenceServerException, match=overflow):
        c.generate(input_ids=LONG, max_tokens=256)
    with TextClient(triton.grpc_url, STREAM, "grpc") as c, pytest.raises(InferenceServerException, match=overflow):
        list(c.stream(input_ids=LONG, max_tokens=256))


def test_mixed_temperatures_share_one_forward_pass(triton: srv.TritonServer) -> None:
    """Two requests of different temperatures batched together: one pass per token, not one per group."""
    passes0 = metric_sum(read_metrics(triton.metrics_url), PASSES_METRIC, model=MODEL)
    done: queue.Queue[tuple[int, object, object]] = queue.Queue()
    with TextClient(triton.grpc_url, MODEL, "grpc") as c:
        before = batch_histogram(c.statistics(), MODEL)
        # the same inputs in both (Triton batches only requests with the same set of inputs; the API sends all)
        requests = [c.prepare(input_ids=[21, 30, 41], max_tokens=12, temperature=0.0, seed=0),
                    c.prepare(input_ids=[22, 30, 42], max_tokens=12, temperature=1.5, seed=5)]
        for i, inputs in enumerate(requests):  # sent back to back: well inside the 100 ms batching window
            c.client.async_infer(MODEL, inputs, partial(lambda i, result, error: done.put((i, result, error)), i))
        answers = [done.get(timeout=120) for _ in requests]
        assert all(error is None for _, _, error in answers), answers
        out = {i: result.as_numpy("output_ids").reshape(-1).tolist() for i, result, _ in answers}
        time.sleep(0.5)  # the server records a batch's statistics just after answering it
        after = batch_histogram(c.statistics(), MODEL)
    assert {b: n - before.get(b, 0) for b, n in after.items() if n != before.get(b, 0)} == {2: 1}  # one batch
    passes = metric_sum(read_metrics(triton.metrics_url), PASSES_METRIC, model=MODEL) - passes0
    assert passes == max(len(v) for v in out.values())  # grouped by temperature it was the sum


@pytest.fixture(scope="module")
def long_prompt(client: openai.OpenAI) -> str:
    """A prompt whose greedy answer runs to 256 tokens (no end-of-text): its streams keep their rows busy."""
    found = next((p for p in (PROMPT, "once upon a time", "numbers 12345", "sehr geehrte", "hello world", "pipelines")
                  if client.completions.create(model=MODEL, prompt=p, max_tokens=256, temperature=0)
                  .usage.completion_tokens == 256), None)
    assert found is not None, "no prompt ran to 256 tokens"  # the tiny random model may end early
    return found


def _streams_now(triton: srv.TritonServer) -> tuple[int, int]:
    """The streaming model's (running, waiting) streams, from its gauge."""
    samples = read_metrics(triton.metrics_url)
    return (int(metric_sum(samples, STREAMS_METRIC, model=STREAM, state="running")),
            int(metric_sum(samples, STREAMS_METRIC, model=STREAM, state="waiting")))


def _overload_round(client: openai.OpenAI, triton: srv.TritonServer, long_prompt: str) -> openai.APIStatusError | None:
    """Two long streams in the rows, two waiting (the gauge says so, and never more), then one more:
    its error, or None when it was served (the first two ended before it came: a round lost to the
    box's load). The four are served to their ends and the gauge goes back to (0, 0)."""
    running = [client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=256, temperature=0, stream=True)
               for _ in range(2)]  # the API answers once their first token is there: both rows taken
    with TextClient(triton.grpc_url, STREAM, "grpc") as c:
        inputs = c.prepare(prompt=long_prompt, max_tokens=256)
    ends: queue.Queue[object] = queue.Queue()  # the waiting streams' final responses (or errors)
    waiting = [grpcclient.InferenceServerClient(triton.grpc_url) for _ in range(2)]
    refused: openai.APIStatusError | None = None
    try:
        for w in waiting:
            w.start_stream(callback=lambda result, error: ends.put(error) if error is not None or
                           result.get_response().parameters["triton_final_response"].bool_param else None)
            w.async_stream_infer(STREAM, inputs, request_id="waits", enable_empty_final_response=True)
        deadline, now = time.monotonic() + 10, (0, 0)
        while now != (2, 2) and time.monotonic() < deadline:
            now = _streams_now(triton)
            assert now[0] <= 2 and now[1] <= 2, now  # 2 rows, deploy.max_waiting 2
        if now == (2, 2):
            try:
                extra = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True)
                assert [c.choices[0].finish_reason for c in extra][-1] in ("stop", "length")
            except openai.APIStatusError as e:
                refused = e
        for r in running:  # served to their ends
            assert [c.choices[0].finish_reason for c in r][-1] in ("stop", "length")
        assert [ends.get(timeout=120) for _ in waiting] == [None, None]  # and the waiting ones, without error
    finally:
        for w in waiting:
            w.stop_stream(cancel_requests=True)
            w.close()
    deadline = time.monotonic() + 30
    while _streams_now(triton) != (0, 0):
        assert time.monotonic() < deadline, f"the gauge stays at {_streams_now(triton)} with no stream open"
        time.sleep(0.05)
    return refused


def test_overload_is_429_with_a_clear_error(client: openai.OpenAI, triton: srv.TritonServer, long_prompt: str) -> None:
    """Both rows busy and two streams waiting (deploy.max_waiting 2): the next stream is refused at once,
    429 through the API with a message naming the setting, counted by the model; the four are served.
    The four hold their places only while the first two generate: on a box so loaded that those end
    before the next request arrives, the round is played again (at most 5 rounds)."""
    refused0 = metric_sum(read_metrics(triton.metrics_url), ERRORS_METRIC, model=STREAM, reason="overloaded")
    refused = next((e for e in (_overload_round(client, triton, long_prompt) for _ in range(5)) if e is not None), None)
    assert refused is not None, "a stream beyond 2 rows and 2 waiting was served in each of 5 rounds"
    assert refused.status_code == 429 and isinstance(refused, openai.RateLimitError)
    assert "overloaded" in refused.body["message"] and "deploy.max_waiting" in refused.body["message"]
    assert metric_sum(read_metrics(triton.metrics_url), ERRORS_METRIC, model=STREAM,
                      reason="overloaded") == refused0 + 1


def test_requests_beyond_the_apis_own_bound_get_429(checkpoint: Path) -> None:
    """An engine that takes the connection and never answers holds the one request allowed in flight:
    the next one is refused at once, and the held one ends with 504 at its deadline."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()  # the kernel completes the handshake; nobody ever speaks gRPC on it
        cfg = ApiConfig(triton_grpc=f"127.0.0.1:{mute.getsockname()[1]}", model=MODEL, stream_model=STREAM,
                        checkpoint=checkpoint, max_in_flight=1, timeout_s=5)
        with serve_api(cfg) as a:
            c = openai.OpenAI(base_url=a.url, api_key="none", max_retries=0, timeout=60)
            held: list[openai.APIStatusError] = []
            t = threading.Thread(target=lambda: held.append(_error(
                lambda: c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4))))
            t.start()
            metrics_url = a.url.replace("/v1", "/metrics")
            deadline = time.monotonic() + 30  # the held request takes its slot (the API's own gauge says so)
            while metric_sum(read_metrics(metrics_url), "llmpipe_api_requests_in_flight") < 1:
                assert time.monotonic() < deadline, "the held request never took its slot"
                time.sleep(0.02)
            e = _error(lambda: c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4))
            assert e.status_code == 429 and "max_in_flight 1" in e.body["message"] and e.body["code"] == "overloaded"
            t.join()
            assert held[0].status_code == 504 and held[0].body["code"] == "timeout"


def test_a_stream_cancelled_while_it_waits_is_never_prefilled(client: openai.OpenAI, triton: srv.TritonServer,
                                                               long_prompt: str) -> None:
    """Both rows busy with long streams, a third stream waits and its client cancels: when a row frees,
    the model drops it unprefilled (its own counter), and the next stream is served."""
    def unstarted() -> float:
        return metric_sum(read_metrics(triton.metrics_url), UNSTARTED_METRIC, model=STREAM)

    before = unstarted()
    running = [client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=256, temperature=0, stream=True)
               for _ in range(2)]  # the API answers once their first token is there: both rows taken
    with TextClient(triton.grpc_url, STREAM, "grpc") as c:
        inputs = c.prepare(prompt=PROMPT, max_tokens=8)
    raw = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        raw.start_stream(callback=lambda result, error: None)
        raw.async_stream_infer(STREAM, inputs, request_id="waits")
        deadline = time.monotonic() + 10
        while _streams_now(triton)[1] != 1:  # it waits for a row (the model's gauge)
            assert time.monotonic() < deadline, f"the third stream never waited: {_streams_now(triton)}"
        raw.stop_stream(cancel_requests=True)  # tritonclient's public cancellation
    finally:
        raw.close()
        for r in running:
            r.close()  # the API cancels them: the rows free and the waiting stream comes up
    deadline = time.monotonic() + 60
    while unstarted() != before + 1:
        assert time.monotonic() < deadline, "the cancelled waiting stream was not dropped before its prefill"
        time.sleep(0.3)
    after = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True)
    assert [c.choices[0].finish_reason for c in after][-1] in ("stop", "length")  # and the model serves on


def test_a_taken_api_port_is_named(checkpoint: Path) -> None:
    cfg = ApiConfig(triton_grpc="127.0.0.1:1", model=MODEL, stream_model=STREAM, checkpoint=checkpoint)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ApiPortBusy, match=f"its port 127.0.0.1:{port} is in use by another process"):
            with serve_api(cfg, port=port):
                pass


def test_the_apis_connections_send_small_writes_at_once() -> None:
    """Nagle's algorithm off on every connection the API accepts: with it on, each streamed event after
    the first waited for the client's delayed ACK (40 ms in TTFT, tokens bunched behind it)."""
    import asyncio

    async def accepted_nodelay() -> int:
        sock = listen_socket("127.0.0.1")
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_client, sock=sock)  # how uvicorn serves the socket
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            flag = await asyncio.wait_for(seen, 10)
            writer.close()
            return flag

    assert asyncio.run(accepted_nodelay()) != 0


@pytest.fixture(scope="module")
def uncached_client(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """The default deployment (no response cache), the batch model's window 200 ms: a request sent within
    it after another would share its dynamic batch."""
    cfg = DeployConfig(model_name=MODEL, max_batch_size=4, preferred_batch_sizes=[4], max_queue_delay_us=200_000,
                       max_prompt_tokens=512, max_tokens_limit=256)
    repo = tmp_path_factory.mktemp("uncached")
    write_model_repository(checkpoint, repo, cfg, 1)
    with srv.serve(repo) as s, serve_api(api_config(s.repo, s.grpc_url)) as a:
        yield openai.OpenAI(base_url=a.url, api_key="none", max_retries=0, timeout=120)


def test_a_short_whole_answer_leaves_the_batch_before_a_long_one(uncached_client: openai.OpenAI) -> None:
    """A 1-token request sent just after a 256-token one (both without ``stream``) returns first: whole
    answers join the streaming model's running batch and leave it at their own last token (in a dynamic
    batch of the batch model it waited for all 256)."""
    done: dict[str, tuple[float, float, int]] = {}  # name: (sent, answered, tokens)

    def one(name: str, max_tokens: int) -> None:
        t0 = time.monotonic()
        r = uncached_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
        done[name] = (t0, time.monotonic(), r.usage.completion_tokens)

    long = threading.Thread(target=one, args=("long", 256))
    long.start()
    time.sleep(0.05)
    one("short", 1)
    long.join()
    (s0, s1, short_tokens), (l0, l1, long_tokens) = done["short"], done["long"]
    assert short_tokens == 1 and long_tokens > 64  # the long answer is long (no early end-of-text)
    assert s1 < l1 and s1 - s0 < (l1 - l0) / 2, done  # answered while the long one still generates
