"""The unigram baseline of the evaluate stage: hand-computed values, the same bytes as the model, the table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from llmpipe.evaluation.baseline import train_token_counts, unigram_log_probs, unigram_metrics
from llmpipe.evaluation.metrics import EvalSequence, evaluate_model

CPU = torch.device("cpu")


def test_unigram_bits_per_byte_by_hand() -> None:
    # train ids 2, 2, 3 over a vocabulary of 4 (0 = eos, 1 = pad): add-one gives p = (1, 1, 3, 2) / 7
    counts = np.array([0, 0, 2, 1])
    byte_len = np.array([0, 0, 1, 2])  # id 2 spells 1 byte, id 3 spells 2
    seqs = [EvalSequence([2, 3, 2], "en"), EvalSequence([3, 3, 1, 1], "en")]  # second: padded after 2 ids
    res = unigram_metrics(seqs, counts, pad_id=1, byte_len=byte_len)
    o = res["overall"]
    # targets: 3, 2 (first sequence), 3 (second; the pad targets do not count)
    nll = -math.log(2 / 7) - math.log(3 / 7) - math.log(2 / 7)
    assert o["tokens"] == 3 and o["bytes"] == 2 + 1 + 2
    assert o["nll_nats"] == pytest.approx(nll, rel=1e-12)
    assert o["bits_per_byte"] == pytest.approx(nll / math.log(2) / 5, rel=1e-12)
    assert o["perplexity"] == pytest.approx(math.exp(nll / 3), rel=1e-12)
    assert o["accuracy"] == pytest.approx(1 / 3)  # always guesses the most frequent id, 2
    assert res["train_tokens"] == 3 and res["smoothing"] == "add-1" and res["vocab_size"] == 4
    assert res["per_language"]["en"]["nll_nats"] == pytest.approx(nll)


def test_log_probs_sum_to_one_and_span_the_model_vocabulary() -> None:
    lp = unigram_log_probs(np.array([5, 0, 3]), vocab=6)  # ids 3..5 exist in the model, never in the data
    assert np.exp(lp).sum() == pytest.approx(1.0)
    assert np.exp(lp[0]) == pytest.approx(6 / 14) and np.exp(lp[5]) == pytest.approx(1 / 14)
    with pytest.raises(ValueError, match="smaller than"):
        unigram_log_probs(np.array([1, 2, 3]), vocab=2)


def test_train_counts_skip_the_padded_tail(tmp_path: Path) -> None:
    ids = np.array([0, 2, 2, 3, 1, 1, 1], dtype=np.uint16)  # 4 real ids, then padding
    ids.tofile(tmp_path / "train-00000.bin")
    index = {"vocab_size": 5, "dtype": "uint16", "splits": {"train": {"shards": [
        {"file": "train-00000.bin", "sequences": 2, "tokens": 4}]}}}
    (tmp_path / "index.json").write_text(json.dumps(index))
    assert train_token_counts(tmp_path).tolist() == [1, 0, 2, 1, 0]
    with pytest.raises(ValueError, match="no split 'val'"):
        train_token_counts(tmp_path, "val")
    with pytest.raises(FileNotFoundError, match="not a tokenize artifact"):
        train_token_counts(tmp_path / "nowhere")


class UnigramLM(torch.nn.Module):
    """The unigram model as a causal LM: the same logits at every position."""

    def __init__(self, log_probs: np.ndarray) -> None:
        super().__init__()
        self.lp = torch.nn.Parameter(torch.tensor(log_probs, dtype=torch.float32))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):  # noqa: ANN201
        return type("Out", (), {"logits": self.lp.expand(*input_ids.shape, -1)})()


def test_baseline_scores_exactly_the_models_targets_and_bytes(toy_lm) -> None:  # noqa: ANN001
    """The unigram as a torch model through evaluate_model (the model's code path) gives the numbers of
    the numpy baseline, overall and per language: same targets, same bytes, same split of languages."""
    from llmpipe.evaluation.config import EvaluateConfig
    from llmpipe.evaluation.data import load_sequences
    from llmpipe.evaluation.model_io import load_model, load_tokenizer
    from llmpipe.evaluation.stage import run_suite

    res = run_suite(toy_lm.pretrain, toy_lm.tokenize, EvaluateConfig(max_sequences=None, prompts=[]), CPU,
                    baseline=True)
    base = res["baseline"]
    tok = load_tokenizer(toy_lm.pretrain)
    vocab = load_model(toy_lm.pretrain, CPU).get_output_embeddings().weight.shape[0]
    lp = unigram_log_probs(train_token_counts(toy_lm.tokenize), vocab=vocab)
    seqs, names, _ = load_sequences(toy_lm.tokenize, "val")
    as_model = evaluate_model(UnigramLM(lp), tok, seqs, language_names=names)
    for scope in [as_model["overall"], *as_model["per_language"].values()]:
        assert scope["bytes"] > 0
    assert base["overall"]["bytes"] == res["metrics"]["overall"]["bytes"] == as_model["overall"]["bytes"]
    assert base["overall"]["tokens"] == res["metrics"]["overall"]["tokens"]
    assert base["overall"]["bits_per_byte"] == pytest.approx(as_model["overall"]["bits_per_byte"], rel=1e-5)
    for lang, m in as_model["per_language"].items():
        assert base["per_language"][lang]["bits_per_byte"] == pytest.approx(m["bits_per_byte"], rel=1e-5)
        assert base["per_language"][lang]["bytes"] == res["metrics"]["per_language"][lang]["bytes"]
    # the toy model learnt its templates: well under the unigram's bits per byte
    ratio = res["metrics"]["overall"]["bits_per_byte"] / base["overall"]["bits_per_byte"]
    assert base["bits_per_byte_ratio"] == pytest.approx(ratio)
    assert ratio < 0.6


def test_stage_reports_model_beside_baseline(toy_lm, fresh_store) -> None:  # noqa: ANN001
    from llmpipe.evaluation.config import EvaluateConfig
    from llmpipe.evaluation.stage import RESULTS, run_evaluate
    from llmpipe.executor import LocalExecutor
    from llmpipe.stage import STAGES, StageContext

    out = fresh_store.new_tmp_dir("evaluate", "k1")
    ctx = StageContext(spec=STAGES["evaluate"], config=EvaluateConfig(max_sequences=8, prompts=[]), pipeline=None,
                       key="k1", out=out, inputs={"model": toy_lm.pretrain, "tokenize": toy_lm.tokenize},
                       input_keys={"pretrain": "p", "tokenize": "t"}, store=fresh_store, executor=LocalExecutor(1))
    stats = run_evaluate(ctx)
    res = json.loads((out / RESULTS).read_text())
    base = res["baseline"]
    assert base["kind"] == "unigram" and base["split"] == "train" and base["train_tokens"] > 0
    assert stats["unigram_bits_per_byte"] == pytest.approx(base["overall"]["bits_per_byte"])
    assert stats["bits_per_byte_vs_unigram"] == pytest.approx(stats["bits_per_byte"] / stats["unigram_bits_per_byte"])
    table = next(r for r in ctx.reports if r.kind == "table").payload
    rows = {r["metric"]: r for r in table}
    assert rows["bits per byte"]["unigram"] == pytest.approx(base["overall"]["bits_per_byte"])
    assert rows["bits per byte ÷ unigram"]["this"] == pytest.approx(stats["bits_per_byte_vs_unigram"])
    assert [r["metric"] for r in table][:3] == ["perplexity", "bits per byte", "bits per byte ÷ unigram"]
    assert {f"{lang}: bits per byte ÷ unigram" for lang in res["metrics"]["per_language"]} <= set(rows)
    md = stats[next(r for r in ctx.reports if r.kind == "stats-markdown").payload]  # beside the previous model
    assert "| metric | this model | ± stderr | unigram |" in md and f"**{base['bits_per_byte_ratio']:.3f}**" in md
