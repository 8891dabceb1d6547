"""A real Triton server (nvidia-pytriton's binary) on a tiny model: HTTP + gRPC, bad requests, load, shutdown."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer
from tritonclient.utils import InferenceServerException

from llmpipe.serving import server as srv
from llmpipe.serving.client import TextClient
from llmpipe.serving.config import DeployConfig
from llmpipe.serving.loadtest import SloViolation, load_test, smoke_test
from llmpipe.serving.repository import write_model_repository
from tests.fixtures.tiny_checkpoint import greedy_reference

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not srv.available(), reason="no Triton binary: run scripts/install.sh")]
MODEL = "tiny_lm"


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[srv.TritonServer]:
    cfg = DeployConfig(model_name=MODEL, max_prompt_tokens=48, max_tokens_limit=32, max_queue_delay_us=20000)
    repo = tmp_path_factory.mktemp("repo")
    write_model_repository(tiny_checkpoint, repo, cfg, 1)
    with srv.serve(repo) as s:
        yield s
    assert s.process.returncode is not None  # stopped
    for port in (s.http_port, s.grpc_port):
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still open after shutdown"




@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_greedy_output_equals_transformers_generate(server: srv.TritonServer, tiny_checkpoint: Path,
                                                    protocol: str) -> None:
    url = server.http_url if protocol == "http" else server.grpc_url
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    with TextClient(url, MODEL, protocol) as c:
        for prompt in ["the quick brown fox", "héllo wörld, numbers 12345"]:
            ids = tok(prompt)["input_ids"]
            ref = greedy_reference(tiny_checkpoint, ids, 10)
            g = c.generate(prompt=prompt, max_tokens=10)
            assert g.output_ids == ref
            assert g.text == tok.decode(ref, skip_special_tokens=True)
            again = c.prepare(prompt=prompt, max_tokens=10)  # built once, sent twice (the load test's way)
            assert c.generate(prepared=again) == g and c.generate(prepared=again) == g
        # Multi-element INT64 ids arrive unchanged (the numpy path of Triton 2.51 + numpy 2 would repeat
        # the first element): the answer matches the reference for these exact, distinct ids.
        ids = [7, 150, 33, 201, 12, 99]
        assert c.generate(input_ids=ids, max_tokens=6).output_ids == greedy_reference(tiny_checkpoint, ids, 6)


def _bad_requests(c: TextClient) -> list[tuple[list, str]]:
    u8 = lambda s: np.frombuffer(s.encode(), dtype=np.uint8).reshape(1, -1)  # noqa: E731
    mt = c.tensor("max_tokens", np.array([[4]], dtype=np.int32), "INT32")
    return [
        ([c.tensor("prompt", np.zeros((1, 0), dtype=np.uint8), "UINT8"), mt], "'prompt' is empty"),
        ([c.tensor("prompt", u8("the quick brown fox " * 30), "UINT8"), mt], "over the limit of 48"),
        ([c.tensor("prompt", np.array([[1.0, 2.0]], dtype=np.float32), "FP32"), mt], "expects 'UINT8'"),
        ([c.tensor("prompt", u8("hi"), "UINT8"),
          c.tensor("max_tokens", np.array([[4, 5]], dtype=np.int32), "INT32")], "max_tokens"),
        ([c.tensor("input_ids", np.array([[[1, 2]]], dtype=np.int64), "INT64"), mt], "input_ids"),
        ([c.tensor("prompt", u8("hi"), "UINT8"),
          c.tensor("max_tokens", np.array([[0]], dtype=np.int32), "INT32")], r"'max_tokens' must be in \[1, 32\]"),
        ([c.tensor("prompt", u8("hi"), "UINT8"),
          c.tensor("max_tokens", np.array([[999]], dtype=np.int32), "INT32")], "got 999"),
        ([mt], "exactly one of"),
    ]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_requests_get_clear_errors_and_server_keeps_serving(server: srv.TritonServer,
                                                                protocol: str) -> None:
    url = server.http_url if protocol == "http" else server.grpc_url
    with TextClient(url, MODEL, protocol) as c:
        for inputs, message in _bad_requests(c):
            with pytest.raises(InferenceServerException, match=message):
                c.infer(inputs)
            assert len(c.generate(prompt="the lazy dog", max_tokens=3).output_ids) >= 1  # still serving
    assert server.process.poll() is None


def test_smoke_and_load_test_report_latency_and_batches(server: srv.TritonServer, tmp_path: Path) -> None:
    assert smoke_test(server.http_url, MODEL, "http")["ok"]
    assert smoke_test(server.grpc_url, MODEL, "grpc")["ok"]
    r = load_test(server.grpc_url, MODEL, protocol="grpc", clients=6, requests=36, max_tokens=4,
                  out_path=tmp_path / "latency.json", slo_p99_ms=None)
    assert r["requests"] == 36 and r["errors"] == 0
    assert 0 < r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"]
    assert sum(int(b) * n for b, n in r["batch_histogram"].items()) == 36  # every request executed once
    assert r["mean_batch_size"] > 1  # 6 concurrent clients + a 20 ms queue delay: the batcher batches
    assert json.loads((tmp_path / "latency.json").read_text())["p99_ms"] == r["p99_ms"]
    with pytest.raises(SloViolation, match="p99 .* > deploy.slo_p99_ms"):
        load_test(server.http_url, MODEL, protocol="http", clients=2, requests=4, max_tokens=2,
                  slo_p99_ms=0.001)


def test_load_test_refuses_non_loopback() -> None:
    with pytest.raises(ValueError, match="loopback"):
        load_test("10.1.2.3:8001", MODEL)


def test_startup_failure_reports_the_log(tmp_path: Path, tiny_checkpoint: Path) -> None:
    repo = tmp_path / "repo"
    write_model_repository(tiny_checkpoint, repo, DeployConfig(model_name="broken"), 1)
    (repo / "broken" / "1" / "model.py").write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(srv.ServerError, match="boom at import|exited with code"):
        with srv.serve(repo, startup_timeout_s=120):
            pass
    logging.getLogger(__name__).info("startup failure surfaced as expected")


@pytest.mark.parametrize("service", ["metrics", "HTTP"])
def test_a_taken_port_stops_the_start_and_names_it(tmp_path: Path, tiny_checkpoint: Path, service: str) -> None:
    """Triton exits when its HTTP port is taken, but starts without metrics when only the metrics port
    is, and reports ready: ``serve`` must refuse both, naming the port, not hand back a server whose
    metrics nobody can scrape."""
    repo = tmp_path / "repo"
    write_model_repository(tiny_checkpoint, repo, DeployConfig(model_name=MODEL, streaming=False), 1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        given = {"metrics_port": port} if service == "metrics" else {"http_port": port}
        with pytest.raises(srv.PortBusy, match=f"its {service} port 127.0.0.1:{port} is in use") as e:
            with srv.serve(repo, startup_timeout_s=120, **given):
                pass
    assert e.value.port == port


def test_busy_port_lines_of_the_triton_log() -> None:
    """The log lines ``serve`` reads a taken port from (Triton 2.51's wording, one per service)."""
    lines = {"HTTP": ("HTTP", 8000), "GRPC": ("gRPC", 8001), "Metrics": ("metrics", 8002)}
    for service, expected in lines.items():
        log = (f"I1203 08:03:36.9 13615 server.cc:674] some line\nE1203 08:03:36.911623 13615 main.cc:257] "
               f"\"failed to start {service} service: Unavailable - Socket '127.0.0.1:{expected[1]}' already in use \"\n")
        assert srv._busy_port(log) == expected
    assert srv._busy_port("I1203 server.cc] Started GRPCInferenceService at 127.0.0.1:8001\n") is None
