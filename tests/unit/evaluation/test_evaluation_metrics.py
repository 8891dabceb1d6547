"""Evaluation numbers against independent computations, on a tiny Llama trained in the fixture."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from llmpipe.evaluation.data import load_sequences
from llmpipe.evaluation.metrics import (
    EvalSequence,
    Tally,
    evaluate_model,
    load_task,
    token_byte_lengths,
)
from llmpipe.evaluation.model_io import load_model, load_tokenizer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def lm(toy_lm):  # noqa: ANN001, ANN201
    return load_model(toy_lm.pretrain, CPU), load_tokenizer(toy_lm.pretrain)


def hand_nll(model, ids: list[int]) -> tuple[float, int, int]:  # noqa: ANN001
    """Sum of -log p(next token), count and correct arg-max, one unpadded sequence at a time, float64."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    nll, correct = 0.0, 0
    for t in range(len(ids) - 1):
        row = logits[t]
        nll += float(torch.logsumexp(row, 0) - row[ids[t + 1]])
        correct += int(int(row.argmax()) == ids[t + 1])
    return nll, len(ids) - 1, correct


def test_perplexity_matches_per_token_loss_summed_by_hand(toy_lm, lm) -> None:  # noqa: ANN001
    model, tok = lm
    seqs, names, _ = load_sequences(toy_lm.tokenize, "val")
    last = seqs[-1]  # the split's last sequence ends in padding
    assert (np.asarray(last.tokens) == tok.pad_token_id).any()
    chosen = [seqs[0], seqs[1], last]
    res = evaluate_model(model, tok, chosen, batch_size=3, language_names=names)
    nll = n = correct = 0
    for s in chosen:
        ids = [int(t) for t in s.tokens if t != tok.pad_token_id]
        a, b, c = hand_nll(model, ids)
        nll, n, correct = nll + a, n + b, correct + c
    o = res["overall"]
    assert o["tokens"] == n
    assert o["nll_nats"] == pytest.approx(nll, rel=1e-5)
    assert o["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert o["accuracy"] == pytest.approx(correct / n)
    assert 1.0 < o["perplexity"] < 5.0  # the model learnt the templates (random weights: ~ vocab size)


def test_bits_per_byte_from_bytes_decoded_by_hand(toy_lm, lm) -> None:  # noqa: ANN001
    model, tok = lm
    seqs, names, _ = load_sequences(toy_lm.tokenize, "val", max_sequences=4)
    res = evaluate_model(model, tok, seqs, language_names=names)["overall"]
    specials = set(tok.all_special_ids)
    by_hand = sum(len(tok.decode([int(t) for t in s.tokens[1:] if int(t) not in specials]).encode("utf-8"))
                  for s in seqs)
    assert res["bytes"] == by_hand
    assert res["bits_per_byte"] == pytest.approx(res["nll_nats"] / math.log(2) / by_hand)


def test_whole_split_bytes_equal_the_tokenize_stage_text_bytes(toy_lm, lm) -> None:  # noqa: ANN001
    from llmpipe.evaluation.config import EvaluateConfig
    from llmpipe.evaluation.stage import run_suite

    res = run_suite(toy_lm.pretrain, toy_lm.tokenize, EvaluateConfig(max_sequences=None, prompts=[]), CPU,
                    model=lm[0])
    assert res["bytes_check"]["match"], res["bytes_check"]
    per = res["metrics"]["per_language"]
    assert set(per) == {"en", "de"}
    for k in ("tokens", "bytes"):
        assert sum(v[k] for v in per.values()) == res["metrics"]["overall"][k]
    assert sum(v["nll_nats"] for v in per.values()) == pytest.approx(res["metrics"]["overall"]["nll_nats"])


class UniformLM(torch.nn.Module):
    """Logits all zero: every next token has probability 1/V, so the answers are known in closed form."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):  # noqa: ANN201
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, self.vocab)})()


def test_uniform_model_gives_closed_form_perplexity_and_bpb(lm) -> None:  # noqa: ANN001
    _, tok = lm
    text = "Die Katze sieht den Fluss. Grüße!"
    ids = tok(text, add_special_tokens=False).input_ids
    res = evaluate_model(UniformLM(len(tok)), tok, [EvalSequence(ids, "de")])["overall"]
    v, n = len(tok), len(ids) - 1
    target_bytes = len(tok.decode(ids[1:]).encode("utf-8"))
    assert res["perplexity"] == pytest.approx(v, rel=1e-6)  # log-softmax runs in float32
    assert res["bits_per_byte"] == pytest.approx(n * math.log2(v) / target_bytes, rel=1e-6)


def test_tally_bits_per_byte_formula() -> None:
    t = Tally(nll=10 * math.log(2), tokens=4, correct=1, bytes=5, sequences=1)
    m = t.metrics()
    assert m["bits_per_byte"] == pytest.approx(2.0)
    assert m["perplexity"] == pytest.approx(math.exp(10 * math.log(2) / 4))
    assert m["accuracy"] == 0.25


def test_byte_lengths_are_exact_for_multibyte_text(lm) -> None:  # noqa: ANN001
    _, tok = lm
    text = "Grüße aus Köln, 日本語 and emoji 🙂."
    ids = tok(text, add_special_tokens=False).input_ids
    lens = token_byte_lengths(tok)
    assert int(lens[ids].sum()) == len(text.encode("utf-8"))
    assert lens[tok.eos_token_id] == 0 and lens[tok.pad_token_id] == 0


@pytest.mark.parametrize("line, msg", [
    ("{not json", ":2: not JSON"),
    ('{"context": "a", "choices": ["x"], "label": 0}', "at least 2"),
    ('{"context": "a", "choices": ["x", "y"], "label": 2}', "'label' must be an integer in [0, 2)"),
])
def test_task_file_errors_name_file_and_line(tmp_path: Path, line: str, msg: str) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"context": "a", "choices": ["x", "y"], "label": 0}\n' + line + "\n")
    with pytest.raises(ValueError) as e:
        load_task(p)
    assert str(p) in str(e.value) and msg in str(e.value).replace(str(p), "")


def test_greedy_generation_is_deterministic_and_counts_tokens(lm) -> None:  # noqa: ANN001
    model, tok = lm
    a = evaluate_model(model, tok, [EvalSequence([1, 2, 3])], prompts=["The cat"], max_new_tokens=8)
    b = evaluate_model(model, tok, [EvalSequence([1, 2, 3])], prompts=["The cat"], max_new_tokens=8)
    assert a["generations"][0]["completion"] == b["generations"][0]["completion"]
    assert a["generations"][0]["new_tokens"] == 8 and a["timings"]["generation_tokens_per_s"] > 0
    assert a["timings"]["generation_seconds"] > 0 and "seconds" not in a["generations"][0]
