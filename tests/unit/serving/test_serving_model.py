"""The generation core of the Triton model file, run in-process against transformers' generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmpipe.serving.triton_model import (
    CPU_ATTENTION,
    BadRequest,
    Generator,
    GenRequest,
    Limits,
    TextDeltas,
    _masks,
    decode_batch,
)
from tests.fixtures.tiny_checkpoint import greedy_reference


@pytest.fixture(scope="module")
def gen(tiny_checkpoint: Path) -> Generator:
    return Generator(str(tiny_checkpoint), Limits(max_prompt_tokens=32, max_tokens_limit=24, default_max_tokens=6))




PROMPTS = ["the quick brown fox", "once upon a time there", "héllo wörld", "numbers 12345"]


def test_greedy_batch_equals_transformers_generate(gen: Generator, tiny_checkpoint: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    reqs = [gen.parse(p.encode(), None, 12, 0.0) for p in PROMPTS]
    assert len({len(r.input_ids) for r in reqs}) > 1  # different lengths: left padding is exercised
    got = gen.generate(reqs)
    for p, r, g in zip(PROMPTS, reqs, got, strict=True):
        assert r.input_ids == tok(p)["input_ids"]
        ref = greedy_reference(tiny_checkpoint, r.input_ids, 12)
        eos = tok.eos_token_id
        assert g == (ref[: ref.index(eos) + 1] if eos in ref else ref)


def test_per_request_max_tokens_and_sampling(gen: Generator) -> None:
    a = gen.parse(None, [5, 6, 7], 3, 0.0)
    b = gen.parse(None, [8, 9], 9, 0.0)
    c = gen.parse(None, [8, 9], 9, 1.0)
    out = gen.generate([a, b, c])
    assert 1 <= len(out[0]) <= 3 and 1 <= len(out[1]) <= 9 and 1 <= len(out[2]) <= 9
    assert all(0 <= t < gen.vocab_size for t in out[2])


@pytest.mark.parametrize(("args", "message"), [
    ((b"", None, 4, 0.0), "'prompt' is empty"),
    ((b"   ", None, 4, 0.0), "'prompt' is empty"),
    ((b"\xff\xfe", None, 4, 0.0), "not valid UTF-8"),
    ((None, None, 4, 0.0), "exactly one of"),
    ((b"hi", [1, 2], 4, 0.0), "exactly one of"),
    ((None, [], 4, 0.0), "'input_ids' is empty"),
    ((None, [1, 99999], 4, 0.0), "outside"),
    ((None, list(range(3, 40)), 4, 0.0), "over the limit of 32"),
    ((b"hi", None, 0, 0.0), r"'max_tokens' must be in \[1, 24\], got 0"),
    ((b"hi", None, 25, 0.0), "got 25"),
    ((b"hi", None, 4, -1.0), "'temperature' must be in"),
    ((b"hi", None, 4, float("nan")), "'temperature' must be in"),
])
def test_bad_requests_are_refused_with_a_reason(gen: Generator, args: tuple, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        gen.parse(*args)


def test_defaults(gen: Generator) -> None:
    assert gen.parse(b"hi", None, None, None).max_tokens == 6


def test_a_batch_is_parsed_request_by_request(gen: Generator) -> None:
    """One tokenizer call for the batch's prompts, yet each request gets its own answer or reason."""
    too_long = (b"x" * 40, None, 4, 0.0)  # more tokens than the limit (32), in the middle of the batch
    raw = [(b"the quick", None, 4, 0.0), (b"\xff", None, 4, 0.0), (None, [5, 6], 3, 0.5),
           too_long, (b"once upon", None, 99, 0.0), (b"numbers 12345", None, None, None)]
    got = gen.parse_batch(raw)
    assert [type(g).__name__ for g in got] == ["GenRequest", "BadRequest", "GenRequest", "BadRequest",
                                               "BadRequest", "GenRequest"]
    assert "not valid UTF-8" in str(got[1]) and "over the limit of 32" in str(got[3]) and "got 99" in str(got[4])
    for r, g in zip(raw, got, strict=True):  # the same as parsing each alone
        if isinstance(g, GenRequest):
            assert g == gen.parse(*r)
    assert got[0].input_ids == gen.tokenizer("the quick")["input_ids"] and got[2] == GenRequest([5, 6], 3, 0.5)


def test_cpu_attention_gives_stock_sdpa_numbers(gen: Generator, tiny_checkpoint: Path) -> None:
    """The served model's attention (GQA heads kept with a mask) against transformers' own SDPA, on a
    left-padded prefill with a 4D mask, a decode step, and an unpadded prompt with no mask."""
    assert gen.attention == CPU_ATTENTION and gen.model.config.num_key_value_heads < gen.model.config.num_attention_heads
    stock = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, attn_implementation="sdpa").eval()
    rows = [gen.tokenizer(p)["input_ids"] for p in PROMPTS]
    ids, keep = _left_padded(rows, gen.pad_id)
    pos = (keep.long().cumsum(-1) - 1).masked_fill(~keep, 1)
    prompt_mask, step_mask = _masks(keep, 1, torch.float32)
    with torch.inference_mode():
        for model_ids, mask, positions in ((ids, prompt_mask, pos), (ids[1:2, -len(rows[1]):], None, None)):
            ours = gen.model(input_ids=model_ids, attention_mask=mask, position_ids=positions).logits
            theirs = stock(input_ids=model_ids, attention_mask=mask, position_ids=positions).logits
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        from transformers import DynamicCache

        caches = [DynamicCache(), DynamicCache()]
        for model, cache in zip((gen.model, stock), caches, strict=True):
            model(input_ids=ids, attention_mask=prompt_mask, position_ids=pos, past_key_values=cache, use_cache=True)
        nxt = torch.full((len(rows), 1), 7)
        steps = [m(input_ids=nxt, attention_mask=step_mask, position_ids=pos[:, -1:] + 1, past_key_values=c,
                   use_cache=True).logits for m, c in zip((gen.model, stock), caches, strict=True)]
        torch.testing.assert_close(steps[0], steps[1], rtol=1e-5, atol=1e-5)


def _left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    keep = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        keep[i, width - len(r):] = True
    return ids, keep


def test_decode_loop_equals_generate_on_a_left_padded_batch(gen: Generator) -> None:
    rows = [gen.tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len({len(r) for r in rows}) > 1  # different lengths: rows with and without left padding
    ids, keep = _left_padded(rows, gen.pad_id)
    with torch.inference_mode():
        ref = gen.model.generate(input_ids=ids, attention_mask=keep.long(), max_new_tokens=14, min_new_tokens=14,
                                 do_sample=False, pad_token_id=gen.pad_id)[:, ids.shape[1]:].tolist()
    got = decode_batch(gen.model, ids, keep, [14] * len(rows), eos_ids=set())  # no EOS: all 14 steps compared
    assert got == ref
    ones = decode_batch(gen.model, ids[1:2, -len(rows[1]):], keep[1:2, -len(rows[1]):], [14], eos_ids=set())
    assert ones == [ref[1]]  # unpadded, alone (no mask at all): the same tokens


def test_decode_loop_stops_each_row_at_its_budget_and_its_eos(gen: Generator) -> None:
    rows = [gen.tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    ids, keep = _left_padded(rows, gen.pad_id)
    free = decode_batch(gen.model, ids, keep, [10, 10, 10], eos_ids=set())
    eos = free[0][3]  # the token row 0 picks 4th: call it end-of-sequence
    got = decode_batch(gen.model, ids, keep, [10, 2, 10], eos_ids={eos})
    assert got[0] == free[0][: free[0].index(eos) + 1] and got[0][-1] == eos
    assert got[1] == free[1][:2]
    assert got[2] == (free[2][: free[2].index(eos) + 1] if eos in free[2] else free[2])


def test_sampling_follows_the_temperature(gen: Generator) -> None:
    ids, keep = _left_padded([gen.tokenizer(PROMPTS[0])["input_ids"]] * 8, gen.pad_id)
    greedy = decode_batch(gen.model, ids, keep, [8] * 8, eos_ids=set())
    cold = decode_batch(gen.model, ids, keep, [8] * 8, eos_ids=set(), temperature=1e-4,
                        rng=torch.Generator().manual_seed(0))
    hot = decode_batch(gen.model, ids, keep, [8] * 8, eos_ids=set(), temperature=5.0,
                       rng=torch.Generator().manual_seed(0))
    assert cold == greedy  # a near-zero temperature samples the argmax
    assert len({tuple(r) for r in hot}) > 1  # a high one spreads the same prompt over different answers


@pytest.mark.parametrize("incremental", [True, False], ids=["DecodeStream", "whole-decode"])
def test_text_deltas_concatenate_to_the_decoded_answer(gen: Generator, incremental: bool) -> None:
    tokenizer = gen.tokenizer if incremental else None
    for prompt in PROMPTS:
        tokens = gen.generate([gen.parse(prompt.encode(), None, 16, 0.0)])[0]
        deltas = TextDeltas(gen.decode, tokenizer)
        pieces = [deltas.add(t, i == len(tokens) - 1) for i, t in enumerate(tokens)]
        assert "".join(pieces) == gen.decode(tokens)
    # a character split over two byte-level tokens is held back until it is complete
    ids = gen.tokenizer("é", add_special_tokens=False)["input_ids"]
    byte_ids = gen.tokenizer.convert_tokens_to_ids(list("".join(gen.tokenizer.convert_ids_to_tokens(ids))))
    assert len(byte_ids) == 2  # one token per UTF-8 byte (the byte-level alphabet is in the vocabulary)
    for last in (False, True):
        deltas = TextDeltas(gen.decode, tokenizer)
        assert deltas.add(byte_ids[0], False) == "" and deltas.add(byte_ids[1], last) == "é"


def test_text_deltas_decode_each_token_once_not_the_whole_answer(gen: Generator) -> None:
    """A stream of n tokens used to decode its whole answer at every token (n² / 2 token decodes): now
    DecodeStream takes each token, and the answer is decoded whole once, for the last piece."""
    text = "héllo wörld, the quick brown fox jumps over the lazy dog; numbers 12345 " * 6
    tokens = gen.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(tokens) > 100
    whole: list[int] = []

    def decode(ids: list[int]) -> str:
        whole.append(len(ids))
        return gen.decode(ids)

    deltas = TextDeltas(decode, gen.tokenizer)
    pieces = [deltas.add(t, i == len(tokens) - 1) for i, t in enumerate(tokens)]
    assert "".join(pieces) == text and sum(1 for p in pieces if p) > len(tokens) / 2
    assert whole == [len(tokens)]  # one whole decode, at the last token


def test_top_k_top_p_and_seeds_pick_tokens_per_row(gen: Generator) -> None:
    """Rows of different sampling in one pass: top_k 1 and a tiny top_p are argmax whatever the
    temperature; a seeded row draws from its own generator, so its tokens do not depend on its
    neighbours; different seeds spread."""
    ids, keep = _left_padded([gen.tokenizer(PROMPTS[0])["input_ids"]] * 6, gen.pad_id)
    greedy = decode_batch(gen.model, ids, keep, [10] * 6, eos_ids=set())[0]
    rows = [GenRequest([], 10, 5.0, top_k=1), GenRequest([], 10, 5.0, top_p=1e-6), GenRequest([], 10, 5.0, seed=3),
            GenRequest([], 10, 0.0), GenRequest([], 10, 5.0, seed=4), GenRequest([], 10, 5.0, top_k=5, seed=3)]
    got = decode_batch(gen.model, ids, keep, [10] * 6, eos_ids=set(), rows=rows)
    assert got[0] == got[1] == got[3] == greedy
    alone = decode_batch(gen.model, ids[:1], keep[:1], [10], eos_ids=set(), rows=[rows[2]])[0]
    assert got[2] == alone and got[2] != got[4]  # its own generator: the same alone; another seed, another answer
    top5 = torch.topk(gen.model(ids[:1]).logits[0, -1], 5).indices.tolist()
    assert got[5][0] in top5


@pytest.mark.parametrize(("extra", "message"), [
    ({"top_k": -1}, "'top_k' must be >= 0"),
    ({"top_p": 0.0}, r"'top_p' must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"'top_p' must be in \(0, 1\]"),
])
def test_bad_sampling_is_refused(gen: Generator, extra: dict, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        gen.parse(b"hi", None, 4, 1.0, **extra)


def test_prompt_and_new_tokens_must_fit_the_context(tiny_checkpoint: Path) -> None:
    g = Generator(str(tiny_checkpoint), Limits(max_prompt_tokens=512, max_tokens_limit=256))
    assert g.context == 512
    assert g.parse(None, [5] * 256, 256, 0.0).max_tokens == 256  # exactly the context
    with pytest.raises(BadRequest, match=r"prompt \(500 tokens\) \+ max_tokens \(256\) = 756 is over the "
                                         r"model's context length of 512 tokens"):
        g.parse(None, [5] * 500, 256, 0.0)
    cached = Generator(str(tiny_checkpoint), Limits(seeded_sampling=True))
    with pytest.raises(BadRequest, match="needs a 'seed'"):
        cached.parse(b"hi", None, 4, 1.0)
    assert cached.parse(b"hi", None, 4, 1.0, seed=1).seed == 1 and cached.parse(b"hi", None, 4, 0.0).seed is None
