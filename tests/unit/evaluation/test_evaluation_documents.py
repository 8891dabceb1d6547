"""Document-level bits per byte (rolling windows over whole held-out documents) and the Kneser-Ney
baseline: by-hand values, every token once, KN beats the unigram, the stage key moves with the keys."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from llmpipe.evaluation.documents import document_metrics, rolling_windows, split_documents

CPU = torch.device("cpu")


class Recorder(torch.nn.Module):
    """A fixed next-token distribution (``log_probs``) that records the inputs it was run on and
    refuses inputs longer than its window, like a model with learned positions."""

    def __init__(self, log_probs: np.ndarray, window: int) -> None:
        super().__init__()
        self.lp = torch.nn.Parameter(torch.tensor(log_probs, dtype=torch.float32))
        self.window, self.seen = window, []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):  # noqa: ANN201
        assert input_ids.shape[1] <= self.window
        self.seen += [r[m.bool()].tolist() for r, m in zip(input_ids, attention_mask, strict=True)]
        return type("Out", (), {"logits": self.lp.expand(*input_ids.shape, -1)})()


def test_rolling_windows_score_every_target_once_with_left_context() -> None:
    for n, w, s in [(2, 4, None), (4, 4, None), (5, 4, None), (23, 4, None), (23, 8, 2), (50, 16, 1)]:
        wins = rolling_windows(n, w, s)
        targets = [p for start, stop, k in wins for p in range(stop - k + 1, stop + 1)]
        assert targets == list(range(1, n))  # each once, in order
        for start, stop, _k in wins:
            assert stop + 1 - start <= w  # the model never reads more than its window
            assert start == max(0, stop + 1 - w)  # as much left context as the window allows
    with pytest.raises(ValueError, match="doc_stride"):
        rolling_windows(10, 4, 4)


def test_short_document_by_hand_and_long_document_through_several_windows() -> None:
    eos = 0
    lp = np.log(np.array([0.1, 0.2, 0.3, 0.25, 0.15]))
    byte_len = np.array([0, 1, 2, 3, 1])
    short = np.array([2, 3, 1, eos])  # fits in one window: prefix EOS + 4 targets
    model = Recorder(lp, window=8)
    res = document_metrics(model, [short], byte_len, window=8, eos_id=eos, bos_id=None)
    nll = -(lp[2] + lp[3] + lp[1] + lp[0])
    assert res["windows"] == 1 and res["tokens"] == 4 and res["bytes"] == 2 + 3 + 1 + 0
    assert res["nll_nats"] == pytest.approx(nll, rel=1e-6)
    assert res["bits_per_byte"] == pytest.approx(nll / math.log(2) / 6, rel=1e-6)
    assert model.seen == [[eos, 2, 3, 1, eos]]

    long = np.array([1, 2, 3, 4] * 7 + [eos])  # 29 targets, window 8 -> 7 + 7 + 7 + 7 + 1
    model = Recorder(lp, window=8)
    res = document_metrics(model, [long], byte_len, window=8, eos_id=eos, bos_id=None, batch_size=2)
    assert res["windows"] == 5 and res["tokens"] == len(long)
    assert res["bytes"] == int(byte_len[long].sum())
    assert res["nll_nats"] == pytest.approx(-lp[long].sum(), rel=1e-6)
    ids = np.concatenate([[eos], long])
    assert model.seen[1] == ids[7:15].tolist()  # targets 8..14, read with the 7 tokens before the first
    bos = np.array([4, 2, 3, eos])  # a document opening with BOS: BOS is the prefix, never a target
    assert document_metrics(Recorder(lp, 8), [bos], byte_len, 8, eos, bos_id=4)["tokens"] == 3


def test_split_documents_keeps_every_token() -> None:
    ids = np.array([5, 6, 0, 7, 0, 8, 9])
    docs = split_documents(ids, 0)
    assert [d.tolist() for d in docs] == [[5, 6, 0], [7, 0], [8, 9]]


def test_kneser_ney_is_a_distribution_over_the_vocabulary() -> None:
    from llmpipe.evaluation.baseline import KneserNey

    vocab, eos = 12, 0
    docs = [np.array([3, 4, 5, 3, 4, 6, eos]), np.array([3, 4, 5, eos]), np.array([7, 4, 5, eos])]
    kn = KneserNey(docs, order=3, vocab=vocab, eos_id=eos, bos_id=None)
    for hist in (["<s>"], ["<s>", "3"], ["3", "4"], ["9", "9"]):
        words = ["</s>", *(str(i) for i in range(1, vocab))]  # every id but EOS spelled as itself
        assert sum(math.exp(kn.word(hist, w)) for w in words) == pytest.approx(1.0, abs=1e-9)


def test_stage_reports_documents_and_kn_beside_unigram(toy_lm, fresh_store) -> None:  # noqa: ANN001
    from llmpipe.evaluation.config import EvaluateConfig
    from llmpipe.evaluation.stage import RESULTS, run_evaluate
    from llmpipe.executor import LocalExecutor
    from llmpipe.stage import STAGES, StageContext

    out = fresh_store.new_tmp_dir("evaluate", "k1")
    cfg = EvaluateConfig(max_sequences=16, prompts=[], documents=6)
    ctx = StageContext(spec=STAGES["evaluate"], config=cfg, pipeline=None, key="k1", out=out,
                       inputs={"model": toy_lm.pretrain, "tokenize": toy_lm.tokenize},
                       input_keys={"pretrain": "p", "tokenize": "t"}, store=fresh_store, executor=LocalExecutor(1))
    stats = run_evaluate(ctx)
    res = json.loads((out / RESULTS).read_text())
    docs, kn, uni = res["metrics"]["documents"], res["kn_baseline"], res["baseline"]
    print({k: stats[k] for k in ("bits_per_byte", "document_bits_per_byte", "unigram_bits_per_byte",
                                 "kn_bits_per_byte", "bits_per_byte_vs_kn", "document_bits_per_byte_vs_kn",
                                 "documents_seconds")})
    assert docs["documents"] == 6 and docs["tokens"] > 0 and docs["documents_total"] >= 6
    assert kn["overall"]["bytes"] == uni["overall"]["bytes"]  # the same held-out bytes as the unigram
    assert kn["overall"]["bits_per_byte"] < uni["overall"]["bits_per_byte"]  # context helps on the toy corpus
    assert kn["order"] == 3 and "Kneser-Ney" in kn["smoothing"]
    assert stats["bits_per_byte_vs_kn"] == pytest.approx(stats["bits_per_byte"] / stats["kn_bits_per_byte"])
    assert stats["document_bits_per_byte"] == pytest.approx(docs["bits_per_byte"])
    assert kn["documents"]["bytes"] == docs["bytes"]
    rows = {r["metric"]: r for r in next(r for r in ctx.reports if r.kind == "table").payload}
    assert rows["bits per byte"]["kn"] == pytest.approx(kn["overall"]["bits_per_byte"])
    assert rows["whole documents: bits per byte"]["this"] == pytest.approx(docs["bits_per_byte"])
    assert "bits per byte ÷ Kneser-Ney" in rows
    md = stats[next(r for r in ctx.reports if r.kind == "stats-markdown").payload]
    assert "Whole documents (6 of" in md and "| Kneser-Ney |" in md


def test_stage_key_moves_with_the_new_keys() -> None:
    from llmpipe.evaluation.config import EvaluateConfig

    base = EvaluateConfig().key_dict()
    for change in ({"documents": 4}, {"doc_stride": 8}, {"doc_window": 64}, {"kn_order": 4},
                   {"kn_max_train_tokens": 1000}):
        assert EvaluateConfig(**change).key_dict() != base, change


def test_kneser_ney_scores_as_the_coherence_stages_arpa_model(tmp_path) -> None:  # noqa: ANN001
    """The baseline is the coherence stage's estimator: on seen ids its document scores are those of
    the ARPA file that estimator writes, read back by its ARPA scorer."""
    from llmpipe.curation.arpa import ArpaModel, write_arpa
    from llmpipe.evaluation.baseline import KneserNey

    eos = 0
    docs = [np.array([3, 4, 5, 3, 4, 6, eos]), np.array([3, 4, 5, eos]), np.array([7, 4, 5, 6, eos])]
    kn = KneserNey(docs, order=3, vocab=10, eos_id=eos, bos_id=None)
    arpa = ArpaModel(write_arpa([[str(t) for t in d[:-1]] for d in docs], tmp_path / "kn.arpa", order=3))
    for doc in ([3, 4, 6, 5], [7, 4, 5, 3, 4]):
        ours = -kn.target_nll(np.array([eos, *doc, eos])).sum() / math.log(10)
        assert ours == pytest.approx(arpa.score(" ".join(map(str, doc))), abs=1e-5)


def test_bos_and_eos_as_one_id() -> None:
    """The tiny preset's tokenizer has BOS = EOS = 0: documents still split whole, and the KN baseline
    charges every EOS target (only a BOS that opens a document is free)."""
    from llmpipe.evaluation.baseline import KneserNey

    ids = np.array([0, 5, 6, 0, 0, 7, 0])  # [BOS] 5 6 EOS [BOS] 7 EOS
    assert [d.tolist() for d in split_documents(ids, 0, bos_id=0)] == [[0, 5, 6, 0], [0, 7, 0]]
    assert [d.tolist() for d in split_documents(ids, 0, bos_id=None)] == [[0], [5, 6, 0], [0], [7, 0]]
    kn = KneserNey([np.array([0, 5, 6, 0]), np.array([0, 7, 0])], order=2, vocab=9, eos_id=0, bos_id=0)
    nll = kn.target_nll(ids)
    assert nll[2] > 0 and nll[5] > 0  # the EOS targets
    assert nll[3] == 0  # the BOS after an EOS


def test_default_windows_are_the_harness_loglikelihood_rolling_windows() -> None:
    """With the default stride our windows are lm-evaluation-harness's own: the model reads the
    same tokens and scores the same targets (the harness's ``max_length`` L reads L inputs and
    predicts L targets; ours counts the last target too: window = L + 1)."""
    utils = pytest.importorskip("lm_eval.utils")
    prefix = -1
    for n, L in [(1, 4), (4, 4), (9, 4), (30, 7)]:
        doc = list(range(100, 100 + n))
        theirs = [(list(ctx) + list(pred), len(pred)) for ctx, pred in (
            utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(doc, prefix, L, 1))]
        toks = [prefix, *doc]
        ours = [(toks[a : b + 1], k) for a, b, k in rolling_windows(len(toks), L + 1)]
        assert ours == theirs  # the same tokens read, the same number of targets at their end
