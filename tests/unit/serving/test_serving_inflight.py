"""In-flight batching of the streaming model, in process: streams that join the running batch at
different decode steps get the tokens they get alone, leave at their budget, their end-of-sequence
token or a stop, and a generation thread (StreamScheduler) serves streams submitted from other
threads, failing only the streams of a step that raised. The KV cache is preallocated row slots (a
join or leave moves no other row) and prompts are prefilled in chunks, each in a decode step's pass."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from llmpipe.serving.triton_model import (
    PACK_LIMIT,
    Generator,
    GenRequest,
    Limits,
    RunningBatch,
    Stream,
    StreamScheduler,
)
from tests.fixtures.tiny_checkpoint import greedy_reference

PROMPTS = ["the quick brown fox", "once upon a time there", "héllo wörld", "numbers 12345", "a b c d e f g h",
           "Sehr geehrte Damen", "x", "pipelines turn raw text into"]
BUDGETS = (12, 3, 8, 1, 16, 5, 9, 14)


@pytest.fixture(scope="module")
def gen(tiny_checkpoint: Path) -> Generator:
    g = Generator(str(tiny_checkpoint), Limits(max_prompt_tokens=32, max_tokens_limit=24))
    g.eos_ids = set()  # every stream runs to its budget unless a test says otherwise
    return g


@pytest.fixture(scope="module")
def requests(gen: Generator) -> list[GenRequest]:
    reqs = [gen.parse(p.encode(), None, n, 0.0) for p, n in zip(PROMPTS, BUDGETS, strict=True)]
    assert len({len(r.input_ids) for r in reqs}) > 3  # prompts of many lengths: the cache merge re-pads
    return reqs


def _collector(got: dict[int, list[tuple[int, bool]]], i: int, stop_after: int | None = None):
    def on_token(tok: int, last: bool) -> bool:
        got.setdefault(i, []).append((tok, last))
        return stop_after is not None and len(got[i]) >= stop_after
    return on_token


def test_streams_joining_at_different_steps_get_their_solo_tokens(gen: Generator, requests: list[GenRequest]) -> None:
    solo = [gen.generate([r])[0] for r in requests]
    got: dict[int, list[tuple[int, bool]]] = {}
    batch = RunningBatch(gen.model, gen.eos_ids, gen.pad_id)
    joins = {0: [0, 1], 2: [2], 3: [3, 4], 7: [5], 8: [6, 7]}  # some join together, some alone, mid-answer
    sizes, steps = [], 0
    for t in range(40):
        batch.add([Stream(requests[i], _collector(got, i)) for i in joins.get(t, [])])
        steps += len(batch) > 0
        batch.step()
        sizes.append(len(batch))
    for i, want in enumerate(solo):
        assert [tok for tok, _ in got[i]] == want, f"stream {i}"
        assert [last for _, last in got[i]] == [k == len(want) - 1 for k in range(len(want))]  # one final, at the end
    assert max(sizes) >= 5 and sizes[-1] == 0  # several rows ran together; every stream left at its end
    assert batch.passes == steps  # one pass per step: a joining group's prompts go in with the decode step


def test_a_stopped_stream_leaves_and_an_eos_ends_a_stream(gen: Generator, requests: list[GenRequest]) -> None:
    solo = [gen.generate([r])[0] for r in requests[:3]]
    eos = solo[0][2]
    got: dict[int, list[tuple[int, bool]]] = {}
    batch = RunningBatch(gen.model, {eos}, gen.pad_id)
    batch.add([Stream(requests[0], _collector(got, 0)), Stream(requests[1], _collector(got, 1, stop_after=1)),
               Stream(requests[2], _collector(got, 2))])
    while len(batch):
        batch.step()
    assert [t for t, _ in got[0]] == solo[0][:3] and got[0][-1] == (eos, True)  # ended at its end-of-sequence
    assert len(got[1]) == 1  # stopped after its first token: nothing more generated for it
    want2 = solo[2][: solo[2].index(eos) + 1] if eos in solo[2] else solo[2]
    assert [t for t, _ in got[2]] == want2  # its neighbours' leaving did not change its tokens


def test_sampled_and_greedy_streams_share_a_batch(gen: Generator, requests: list[GenRequest]) -> None:
    greedy = gen.generate([requests[0]])[0]
    hot = [GenRequest(requests[4].input_ids, 16, 5.0) for _ in range(4)]
    got: dict[int, list[tuple[int, bool]]] = {}
    batch = RunningBatch(gen.model, set(), gen.pad_id, rng=torch.Generator().manual_seed(0))
    batch.add([Stream(requests[0], _collector(got, 0)), *(Stream(r, _collector(got, 1 + k)) for k, r in enumerate(hot))])
    while len(batch):
        batch.step()
    assert [t for t, _ in got[0]] == greedy  # the greedy row is argmax whatever its neighbours sample
    assert len({tuple(got[1 + k]) for k in range(4)}) > 1  # the hot rows spread over different answers


def test_the_scheduler_serves_streams_from_many_threads(gen: Generator, requests: list[GenRequest]) -> None:
    solo = [gen.generate([r])[0] for r in requests]
    got: dict[int, list[tuple[int, bool]]] = {}
    finished = {i: threading.Event() for i in range(len(requests))}
    errors: list[tuple[Stream, Exception]] = []
    passes: list[int] = []

    def stream(i: int) -> Stream:
        collect = _collector(got, i)

        def on_token(tok: int, last: bool) -> bool:
            collect(tok, last)
            if last:
                finished[i].set()
            return False
        return Stream(requests[i], on_token)

    sched = StreamScheduler(RunningBatch(gen.model, set(), gen.pad_id), 3, lambda s, e: errors.append((s, e)),
                            passes.append)
    try:
        threads = [threading.Thread(target=sched.submit, args=([stream(i)],)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for i in range(len(requests)):
            assert finished[i].wait(60), f"stream {i} did not finish"
    finally:
        sched.stop()
    assert not errors
    assert {i: [t for t, _ in v] for i, v in got.items()} == dict(enumerate(solo))
    assert sum(passes) >= max(BUDGETS)  # the passes were reported (when the thread idled or stopped)


def test_a_step_that_raises_fails_its_streams_and_the_next_ones_are_served(gen: Generator,
                                                                         requests: list[GenRequest]) -> None:
    vocab = gen.vocab_size
    bad = GenRequest([1, vocab + 5], 4, 0.0)  # past the embedding table (parse refuses it; here it reaches the model)
    errors: list[tuple[Stream, Exception]] = []
    failed = threading.Event()
    done = threading.Event()
    got: dict[int, list[tuple[int, bool]]] = {}

    def on_error(s: Stream, e: Exception) -> None:
        errors.append((s, e))
        failed.set()

    def on_token(tok: int, last: bool) -> bool:
        got.setdefault(0, []).append((tok, last))
        if last:
            done.set()
        return False

    sched = StreamScheduler(RunningBatch(gen.model, set(), gen.pad_id), 4, on_error)
    try:
        sched.submit([Stream(bad, lambda tok, last: False)])
        assert failed.wait(60)
        sched.submit([Stream(requests[2], on_token)])
        assert done.wait(60)
    finally:
        sched.stop()
    assert len(errors) == 1 and isinstance(errors[0][1], IndexError)
    assert [t for t, _ in got[0]] == gen.generate([requests[2]])[0]


def test_the_scheduler_bounds_its_waiting_list_and_reports_its_depth(gen: Generator,
                                                                     requests: list[GenRequest]) -> None:
    """3 rows and 2 waiting: of 8 streams submitted at once, 3 are refused; the (running, waiting) reports
    (the model's ``llmpipe_streams`` gauge) are states the scheduler passed through, never past the
    bounds, each a change, and the last one (0, 0) once every stream ended."""
    depths: list[tuple[int, int]] = []
    finished = threading.Event()
    ended: list[int] = []

    def stream(i: int) -> Stream:
        def on_token(tok: int, last: bool) -> bool:
            if last:
                ended.append(i)
                if len(ended) == 5:
                    finished.set()
            return False
        return Stream(requests[i], on_token)

    sched = StreamScheduler(RunningBatch(gen.model, set(), gen.pad_id), 3, lambda s, e: None,
                            max_waiting=2, on_depth=lambda running, waiting: depths.append((running, waiting)))
    try:
        refused = sched.submit([stream(i) for i in range(8)])
        assert finished.wait(60)
        deadline = time.monotonic() + 10
        while depths[-1] != (0, 0):  # the last leave is reported after the step that ended it
            assert time.monotonic() < deadline, depths
            time.sleep(0.01)
    finally:
        sched.stop()
    assert len(refused) == 3 and sorted(ended) == [0, 1, 2, 3, 4]
    assert all(r <= 3 and w <= 5 and r + w <= 5 for r, w in depths), depths
    assert (3, 2) in depths and all(a != b for a, b in zip(depths, depths[1:], strict=False))


def test_prompts_prefilled_in_small_chunks_give_transformers_greedy_tokens(gen: Generator, tiny_checkpoint: Path,
                                                                           requests: list[GenRequest]) -> None:
    """Prompts cut into chunks of 3 tokens, prefilled between other rows' decode steps, rows leaving
    and joining at different steps: each stream's tokens are transformers' greedy continuation."""
    got: dict[int, list[tuple[int, bool]]] = {}
    batch = RunningBatch(gen.model, gen.eos_ids, gen.pad_id, chunk_tokens=3)
    joins = {0: [0, 1], 2: [2], 3: [3, 4], 7: [5], 8: [6, 7]}
    prefilled: list[int] = []
    handle = gen.model.register_forward_pre_hook(lambda m, a, kw: prefilled.append(_prompt_tokens(batch, kw)),
                                                 with_kwargs=True)
    try:
        for t in range(60):
            batch.add([Stream(requests[i], _collector(got, i)) for i in joins.get(t, [])])
            batch.step()
    finally:
        handle.remove()
    assert len(batch) == 0
    for i, r in enumerate(requests):
        want = greedy_reference(tiny_checkpoint, r.input_ids, r.max_tokens)  # up to its end-of-text, if any
        assert [tok for tok, _ in got[i]][: len(want)] == want, f"stream {i}"
    assert max(prefilled) == 3 and sum(prefilled) == sum(len(r.input_ids) for r in requests)  # in chunks of 3


def _prompt_tokens(batch: RunningBatch, kwargs: dict) -> int:
    """The prompt tokens of a forward pass of ``batch`` about to run: its tokens but the decoding rows'
    one each (a decode step: none; a packed pass: the chunk)."""
    ids = kwargs["input_ids"]
    if ids.shape[0] > 1:  # a decode step's rows
        return 0
    return int(ids.shape[1]) - sum(s.filled == len(s.request.input_ids) for s in batch.streams)


def _cache_tensors(batch: RunningBatch) -> list[torch.Tensor]:
    return [t for layer in batch.cache.layers for t in (layer.keys, layer.values)]


def test_joins_and_leaves_write_rows_in_place_and_move_no_other_row(gen: Generator,
                                                                   requests: list[GenRequest]) -> None:
    """The cache is allocated once (max_rows x the model's positions); a join writes only its own row,
    a leave frees its row, and a running row's cached keys stay where they are, unchanged."""
    batch = RunningBatch(gen.model, gen.eos_ids, gen.pad_id, max_rows=4)
    tensors = _cache_tensors(batch)
    ptrs = [t.data_ptr() for t in tensors]
    assert tensors[0].shape[0] == 4 and tensors[0].shape[2] == gen.model.config.max_position_embeddings
    got: dict[int, list[tuple[int, bool]]] = {}
    long_ = GenRequest(requests[4].input_ids, 20, 0.0)  # the row watched: it runs through every join and leave
    batch.add([Stream(long_, _collector(got, 0)), Stream(requests[3], _collector(got, 1))])  # 1 token: leaves
    batch.step()
    row = batch.streams[0].slot
    n = len(long_.input_ids)
    before = [t[row, :, :n].clone() for t in tensors]
    for t, i in ((1, 1), (2, 2), (4, 5), (5, 6)):  # joins (some into a row another stream left), leaves
        batch.add([Stream(requests[i], _collector(got, 10 + t))])
        batch.step()
        batch.step()
        assert [x.data_ptr() for x in _cache_tensors(batch)] == ptrs  # never reallocated, never replaced
        assert all(torch.equal(t[row, :, :n], b) for t, b in zip(_cache_tensors(batch), before, strict=True))
        assert any(s.slot == row and s.request is long_ for s in batch.streams)  # it kept its row
    while len(batch):
        batch.step()
    assert [tok for tok, _ in got[0]] == gen.generate([long_])[0]


def _gaps(gen: Generator, chunk: int) -> tuple[list[int], int]:
    """A running stream's gaps between tokens, in prompt tokens prefilled between them, while a
    200-token prompt joins; and the forward passes the joining prompt took up to its first token."""
    long_prompt = GenRequest([(7 * i) % gen.vocab_size for i in range(200)], 4, 0.0)
    running = GenRequest([5, 6, 7], 30, 0.0)
    filled: list[int] = []  # the joining prompt's tokens in the cache at each token of the running stream
    first: list[int] = []  # the passes run when the joining stream got its first token
    batch = RunningBatch(gen.model, set(), gen.pad_id, chunk_tokens=chunk)

    def watch(tok: int, last: bool) -> bool:
        filled.append(joining.filled)
        return False

    def newcomer(tok: int, last: bool) -> bool:
        first.append(batch.passes)
        return False

    joining = Stream(long_prompt, newcomer)
    batch.add([Stream(running, watch)])
    batch.step()
    batch.step()
    joined_at = batch.passes
    batch.add([joining])
    while len(batch):
        batch.step()
    return [b - a for a, b in zip(filled, filled[1:], strict=False)], first[0] - joined_at


def test_a_long_prompt_joining_delays_a_running_stream_by_one_chunk_at_most(gen: Generator) -> None:
    """Between two tokens of a running stream at most ``chunk_tokens`` prompt tokens are prefilled
    (forward passes counted, not time); in one pass (a chunk as long as the prompt) the whole
    200-token prompt sits between two of its tokens."""
    gaps, chunks = _gaps(gen, 32)
    assert max(gaps) == 32 and chunks == 7  # 200 tokens: 6 chunks of 32, then the last 8, one pass each
    whole, one = _gaps(gen, 256)
    assert max(whole) == 200 and one == 1


@pytest.mark.parametrize("pack_limit", [0, PACK_LIMIT])
def test_a_prompt_prefilled_in_chunks_into_a_freed_lower_row_gets_its_solo_tokens(gen: Generator,
                                                                                 requests: list[GenRequest],
                                                                                 pack_limit: int) -> None:
    """A stream joins a row below a decoding one (a row freed by a stream that left) and its prompt
    takes several chunks, each packed with the decoding row's next token, or (``pack_limit`` 0) in
    passes of their own: then the decode steps between its chunks run over it as a hole (fed a pad,
    its token ignored) and must leave its prompt's cached columns as its chunks wrote them."""
    batch = RunningBatch(gen.model, gen.eos_ids, gen.pad_id, max_rows=4, chunk_tokens=2, pack_limit=pack_limit)
    got: dict[int, list[tuple[int, bool]]] = {}
    short, running = GenRequest(requests[3].input_ids, 1, 0.0), GenRequest(requests[5].input_ids, 24, 0.0)
    batch.add([Stream(short, _collector(got, 0)), Stream(running, _collector(got, 1))])
    while any(s.request is short for s in batch.streams) or 1 not in got:  # it left; the other decodes
        batch.step()
    joining = GenRequest(requests[7].input_ids, 10, 0.0)
    assert len(joining.input_ids) >= 6  # three chunks or more
    batch.add([Stream(joining, _collector(got, 2))])
    new, old = (next(s for s in batch.streams if s.request is r) for r in (joining, running))
    assert new.slot < old.slot and old.tokens > 0  # below a decoding row
    while len(batch):
        batch.step()
    assert [t for t, _ in got[2]] == gen.generate([joining])[0]
    assert [t for t, _ in got[1]] == gen.generate([running])[0]


@pytest.mark.parametrize(("chunk", "pack_limit"), [(2, PACK_LIMIT), (64, PACK_LIMIT), (64, 0)])
def test_a_join_between_running_rows_and_a_free_row_gets_its_solo_tokens(gen: Generator, requests: list[GenRequest],
                                                                        chunk: int, pack_limit: int) -> None:
    """Rows 0 and 3 decode, row 2 is free, a stream joins row 1: its prompt goes in with their decode
    steps, in chunks of 2 (several passes) or at once, or (``pack_limit`` 0) in a pass of its own
    before the step; everyone gets their solo tokens."""
    batch = RunningBatch(gen.model, gen.eos_ids, gen.pad_id, max_rows=4, chunk_tokens=chunk, pack_limit=pack_limit)
    got: dict[int, list[tuple[int, bool]]] = {}
    reqs = [GenRequest(requests[0].input_ids, 20, 0.0), GenRequest(requests[6].input_ids, 1, 0.0),
            GenRequest(requests[3].input_ids, 1, 0.0), GenRequest(requests[2].input_ids, 20, 0.0)]
    batch.add([Stream(r, _collector(got, i)) for i, r in enumerate(reqs)])
    while len(batch) > 2:  # rows 1 and 2 leave after their one token
        batch.step()
    joining = GenRequest(requests[1].input_ids, 8, 0.0)
    batch.add([Stream(joining, _collector(got, 4))])
    assert sorted(s.slot for s in batch.streams) == [0, 1, 3]
    passes = batch.passes
    batch.step()
    assert batch.passes - passes == (2 if pack_limit == 0 else 1)  # the chunk and the decode step: one pass
    while len(batch):
        batch.step()
    for i, r in enumerate([*reqs, joining]):
        assert [t for t, _ in got[i]] == gen.generate([r])[0], f"stream {i}"


def test_only_streams_that_waited_for_a_row_are_asked_whether_their_client_cancelled(
        gen: Generator, requests: list[GenRequest]) -> None:
    """One row: the first stream joins the idle batch without a question (each one is a round trip to
    the server that every running stream's next step waits for); the second waits for the row and is
    asked before its prefill, and dropped, unprefilled, since its client went."""
    asked: list[int] = []
    dropped: list[Stream] = []
    finished = threading.Event()
    got: dict[int, list[tuple[int, bool]]] = {}

    def cancelled(i: int, answer: bool):
        def ask() -> bool:
            asked.append(i)
            return answer
        return ask

    def on_token(tok: int, last: bool) -> bool:
        got.setdefault(0, []).append((tok, last))
        if last:
            finished.set()
        return False

    sched = StreamScheduler(RunningBatch(gen.model, set(), gen.pad_id, max_rows=1), 1, lambda s, e: None,
                            on_cancelled=dropped.append)
    try:
        first = Stream(requests[4], on_token, cancelled=cancelled(0, False))  # 16 tokens: the row stays taken
        second = Stream(requests[1], _collector(got, 1), cancelled=cancelled(1, True))
        sched.submit([first])
        deadline = time.monotonic() + 30
        while not got.get(0):
            assert time.monotonic() < deadline, "the first stream never started"
            time.sleep(0.001)
        sched.submit([second])
        assert finished.wait(60)
        deadline = time.monotonic() + 30
        while not dropped:
            assert time.monotonic() < deadline, "the waiting stream was never asked"
            time.sleep(0.01)
    finally:
        sched.stop()
    assert asked == [1] and dropped == [second] and 1 not in got
