"""SFT packing: packed pairs do not see each other (on logits), and the loss stays on response tokens.

The model is the tiny random Llama of ``tests/fixtures/tiny_checkpoint.py`` (hidden 64, SDPA on CPU).
"""

from __future__ import annotations

import pytest
import torch

from llmpipe.posttrain import sft
from tests.fixtures.tiny_checkpoint import make_tiny_checkpoint

PAIRS = [("Say this word twice: river", "river river"), ("What is 3 plus 4?", "7"),
         ("Écris ce mot en majuscules : pomme", "POMME")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("packing") / "ckpt")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def _rows(tok: object) -> list[tuple[list[int], list[int]]]:
    return [sft.encode_pair(tok, [{"role": "user", "content": p}], r, 128) for p, r in PAIRS]


def test_a_packed_pairs_logits_equal_its_logits_alone(tiny: tuple[object, object]) -> None:
    model, tok = tiny
    rows = _rows(tok)
    with torch.no_grad():
        packed = sft.batch_logits(model, sft.collate_packed([rows], tok.pad_token_id))[0]
        at = 0
        for ids, _ in rows:
            alone = sft.batch_logits(model, sft.collate([(ids, ids)], tok.pad_token_id))[0]
            assert torch.allclose(packed[at: at + len(ids)], alone, atol=1e-5), f"pair at {at} sees its neighbours"
            at += len(ids)
    sft.check_packing(model)  # the stage's own guard agrees


def test_the_same_row_with_a_plain_mask_leaks(tiny: tuple[object, object]) -> None:
    """The control: the packed row under an all-ones 2-D mask (one sequence) changes the later pairs'
    logits, so the test above would see a leak."""
    model, tok = tiny
    rows = _rows(tok)
    b = sft.collate_packed([rows], tok.pad_token_id)
    with torch.no_grad():
        blocked = sft.batch_logits(model, b)[0]
        leaky = model(input_ids=b["input_ids"], attention_mask=torch.ones_like(b["input_ids"]),
                      position_ids=b["position_ids"], use_cache=False).logits[0]
    first = len(rows[0][0])
    assert torch.allclose(blocked[:first], leaky[:first], atol=1e-5)
    assert not torch.allclose(blocked[first:], leaky[first:], atol=1e-3)


def test_packed_loss_covers_the_same_response_tokens_as_padded(tiny: tuple[object, object]) -> None:
    model, tok = tiny
    rows = _rows(tok)
    packed, padded = sft.collate_packed(sft.pack(rows, 64), tok.pad_token_id), sft.collate(rows, tok.pad_token_id)
    n_response = sum(sum(v != sft.IGNORE for v in y) for _, y in rows)
    assert int((packed["labels"] != sft.IGNORE).sum()) == n_response
    with torch.no_grad():
        s1, n1 = sft.response_loss_terms(sft.batch_logits(model, packed), packed["labels"])
        s2, n2 = sft.response_loss_terms(sft.batch_logits(model, padded), padded["labels"])
    # shifted by one inside a packed row, a pair's last token would predict the next pair's first token:
    # that target is a prompt token (IGNORE), so no loss crosses from one pair into the next
    assert int(n1) == int(n2) == n_response
    assert float(s1) == pytest.approx(float(s2), rel=1e-5)


def test_pack_keeps_every_pair_within_the_row_length_and_cuts_padding() -> None:
    rows = [([1] * n, [1] * n) for n in (50, 40, 30, 20, 10, 60, 5)]
    bins = sft.pack(rows, 64)
    assert sorted(len(x) for b in bins for x, _ in b) == sorted(len(x) for x, _ in rows)
    assert all(sum(len(x) for x, _ in b) <= 64 for b in bins) and len(bins) == 4
    b = sft.collate_packed(bins, 0)
    assert b["position_ids"][1].tolist() == list(range(50)) + list(range(10))  # restarts per pair
    packed = sft.padding_share([[sum(len(x) for x, _ in b) for b in bins]])
    assert packed < sft.padding_share([[len(x) for x, _ in rows]])
