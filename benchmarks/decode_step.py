"""The streaming engine's decode step, in one process: CPU time per step of ``RunningBatch`` (the
preallocated row-slot KV cache, chunked prefill) against the plain decode loop of the same model.

At the tiny model's size a decode step is under 2 ms of CPU, and what the engine does around the
forward pass (positions, the attention mask, where the new keys and values go, what attention reads,
a join's prefill) costs tenths of a millisecond: a server-level figure cannot separate that from a
shared box's noise (``serve_vs_vllm.py`` read 0.861 on a quiet box after the slot cache came in,
1.142 before; under load the same code spread 0.88-1.19). Here it is measured alone:

* ours: a ``RunningBatch`` of ``--rows`` (8) rows serving ``--streams`` (48) streams of the load
  test's prompts, budgets of 40-63 tokens (so rows leave at different steps and a waiting stream
  joins the freed row, prefilled with the decode steps, as under the server's scheduler); CPU time
  (``time.process_time``, one torch thread) of each step, the median of the steps that only decode
  (leaves included), and for context the mean over all steps (a join's prefill chunk included);
* plain: ``decode_batch`` (the batch model's loop: transformers' ``DynamicCache``, one 4-D mask
  built once, no joins) over ``--rows`` of the same prompts for 63 tokens: a decode step with no
  in-flight bookkeeping at all (its CPU time ÷ its steps).

Also printed: the median step with a join (a prompt going in) and the CPU per token over every step
(the figure a server's tokens/s follows). Rounds alternate them (``--rounds``, after a warm-up); each
figure is its median round. The last line: ours ÷ plain per decode step (1.0: the in-flight engine's
bookkeeping costs nothing).
``--against FILE`` adds a third path: the ``RunningBatch`` of another copy of ``triton_model.py`` (e.g.
``git show HEAD~3:llmpipe/serving/triton_model.py > /tmp/old.py``), measured in the same rounds.
``--profile`` prints cProfile's top functions of one round of ours.

    .venv/bin/python benchmarks/decode_step.py [--rounds 7] [--rows 8] [--streams 48] [--hidden 128]
        [--against FILE] [--profile] [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

# benchmarks/ holds scripts named like stdlib modules (tokenize.py): keep it off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.fixtures

import argparse  # noqa: E402 - after the path fix (these import tokenize)
import cProfile  # noqa: E402
import importlib.util  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks._common import result  # noqa: E402
from llmpipe.serving import triton_model  # noqa: E402
from llmpipe.serving.loadtest import DEFAULT_PROMPTS  # noqa: E402
from tests.fixtures.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

MAX_TOKENS = 64


def load_module(path: Path) -> ModuleType:
    """Another copy of ``triton_model.py`` as a module of its own (its ``RunningBatch`` is measured)."""
    spec = importlib.util.spec_from_file_location("triton_model_against", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--against {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def workload(gen: Any, streams: int) -> list[Any]:
    """``streams`` greedy requests: the load test's prompts in turn, budgets 40-63 (rows leave apart)."""
    return [triton_model.GenRequest(gen.tokenizer(DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)])["input_ids"],
                                    40 + (i * 7) % (MAX_TOKENS - 40), 0.0) for i in range(streams)]


def run_engine(module: ModuleType, gen: Any, reqs: list[Any], rows: int) -> tuple[list[float], list[float],
                                                                                 list[list[int]]]:
    """A ``RunningBatch`` of ``module`` serving ``reqs`` through ``rows`` rows, a waiting stream joining
    as soon as a row is free (as the scheduler does): (CPU seconds of each step that only decoded, of
    each step with a prefill (a join), each stream's tokens)."""
    try:
        batch = module.RunningBatch(gen.model, set(), gen.pad_id, max_rows=rows)
    except TypeError:  # the engine before the slot cache: no row bound of its own
        batch = module.RunningBatch(gen.model, set(), gen.pad_id)
    out: list[list[int]] = [[] for _ in reqs]

    def stream(i: int) -> Any:
        def on_token(tok: int, last: bool) -> bool:
            out[i].append(tok)
            return False
        return module.Stream(module.GenRequest(reqs[i].input_ids, reqs[i].max_tokens, 0.0), on_token)

    waiting = list(range(len(reqs)))
    decode: list[float] = []
    joins: list[float] = []
    while waiting or len(batch):
        room = rows - len(batch)
        new = [stream(i) for i in waiting[:room]]
        t0 = time.process_time()
        batch.add(new)
        joining = bool(new) or bool(getattr(batch, "prefilling", ()))  # a prompt goes in during this step
        batch.step()
        (joins if joining else decode).append(time.process_time() - t0)
        waiting = waiting[room:]
    return decode, joins, out


def run_plain(gen: Any, reqs: list[Any], rows: int) -> tuple[float, int]:
    """``decode_batch`` over the first ``rows`` requests, ``MAX_TOKENS - 1`` tokens each: (CPU seconds, steps)."""
    batch = reqs[:rows]
    width = max(len(r.input_ids) for r in batch)
    ids = torch.full((rows, width), gen.pad_id, dtype=torch.long)
    keep = torch.zeros((rows, width), dtype=torch.bool)
    for row, r in enumerate(batch):
        ids[row, width - len(r.input_ids):] = torch.tensor(r.input_ids)
        keep[row, width - len(r.input_ids):] = True
    steps = MAX_TOKENS - 1
    t0 = time.process_time()
    triton_model.decode_batch(gen.model, ids, keep, [steps] * rows, set(), rows=batch)
    return time.process_time() - t0, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="rounds, each timing every path once (after a warm-up)")
    ap.add_argument("--rows", type=int, default=8, help="rows of the running batch (the model's max_batch_size)")
    ap.add_argument("--streams", type=int, default=48, help="streams served per round")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (4 heads)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--against", type=Path, help="another triton_model.py whose RunningBatch is measured too")
    ap.add_argument("--profile", action="store_true", help="cProfile one round of ours; print the top functions")
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (not a figure)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.streams = 1, 12
    torch.set_num_threads(1)  # the served model's default here (1 compute thread); steadier on a shared box
    with tempfile.TemporaryDirectory(prefix="decode-step-") as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "ckpt", hidden=args.hidden, layers=args.layers)
        gen = triton_model.Generator(str(ckpt), triton_model.Limits())
    reqs = workload(gen, args.streams)
    engines = {"ours": triton_model}
    if args.against is not None:
        engines["against"] = load_module(args.against)
    per_step: dict[str, list[float]] = {name: [] for name in [*engines, "plain"]}  # decode steps, per round
    whole: dict[str, list[float]] = {name: [] for name in engines}  # CPU per token, all steps, per round
    join_step: dict[str, list[float]] = {name: [] for name in engines}  # steps with a prompt going in
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up (first calls pay for lazy set-ups)
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            decode, joins, tokens[name] = run_engine(engines[name], gen, reqs, args.rows)
            if r:
                per_step[name].append(statistics.median(decode) * 1000)
                join_step[name].append(statistics.median(joins) * 1000)
                whole[name].append((sum(decode) + sum(joins)) / sum(map(len, tokens[name])) * 1e6)
        cpu, steps = run_plain(gen, reqs, args.rows)
        if r:
            per_step["plain"].append(cpu / steps * 1000)
    if "against" in tokens and tokens["against"] != tokens["ours"]:
        raise SystemExit("ours and --against gave different tokens")
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(run_engine, triton_model, gen, reqs, args.rows)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    med = {name: statistics.median(v) for name, v in per_step.items()}
    for name, v in per_step.items():
        print(f"{name:8s} CPU ms per decode step: {med[name]:.3f} (rounds {', '.join(f'{x:.3f}' for x in v)})")
    for name, v in join_step.items():
        print(f"{name:8s} CPU ms per step with a join (its prefill): {statistics.median(v):.3f} "
              f"(rounds {', '.join(f'{x:.3f}' for x in v)})")
    for name, v in whole.items():
        print(f"{name:8s} CPU µs per token, every step (joins' prefills included): {statistics.median(v):.1f} "
              f"(rounds {', '.join(f'{x:.1f}' for x in v)})")
    print(f"{args.rows} rows, {args.streams} streams of 40-63 tokens, hidden {args.hidden}, {args.layers} layers, "
          f"1 torch thread, {args.rounds} round(s)")
    result("decode_step_vs_plain", med["ours"] / med["plain"], "<=", 1.1)


if __name__ == "__main__":
    main()
