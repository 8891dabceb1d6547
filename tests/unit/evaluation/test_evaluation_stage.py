"""The evaluate stage on real tokenize/pretrain-shaped artifacts, with the regression table."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from llmpipe.evaluation.config import EvaluateConfig, TaskConfig
from llmpipe.evaluation.stage import RESULTS, run_evaluate
from llmpipe.executor import LocalExecutor
from llmpipe.stage import STAGES, StageContext


def make_ctx(store, cfg: EvaluateConfig, inputs: dict[str, Path], out: Path, key: str,  # noqa: ANN001
             tokenize_key: str = "tz-1") -> StageContext:
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(spec=STAGES["evaluate"], config=cfg, pipeline=None, key=key, out=out, inputs=inputs,
                        input_keys={"pretrain": f"pre-{key}", "tokenize": tokenize_key}, store=store,
                        executor=LocalExecutor(1))


def test_stage_writes_results_and_compares_with_previous(toy_lm, fresh_store, tmp_path: Path) -> None:  # noqa: ANN001
    task = tmp_path / "cloze.jsonl"
    task.write_text(json.dumps({"context": "The cat sees the red", "choices": [" ball.", " river."], "label": 0})
                    + "\n")
    cfg = EvaluateConfig(max_sequences=12, prompts=["The dog"], max_new_tokens=6,
                         tasks=[TaskConfig(name="cloze", path=str(task))],
                         harness={"tasks": ["tiny_mc", "tiny_docs"], "batch_size": 4})
    inputs = {"model": toy_lm.pretrain, "tokenize": toy_lm.tokenize}

    ctx1 = make_ctx(fresh_store, cfg, inputs, fresh_store.new_tmp_dir("evaluate", "k1"), "k1")
    stats1 = run_evaluate(ctx1)
    res1 = json.loads((ctx1.out / RESULTS).read_text())
    assert res1["metrics"]["overall"]["perplexity"] == pytest.approx(stats1["perplexity"])
    assert res1["data"]["sequences_used"] == 12 and res1["settings"]["max_sequences"] == 12
    assert res1["metrics"]["harness"]["tasks"]["cloze"]["samples"] == 1  # evaluate.tasks: scored by the harness
    assert "tasks" not in res1["metrics"]
    assert stats1["previous_key"] is None
    # the harness's numbers, their standard errors and the config they were computed with, side by side
    harness = res1["metrics"]["harness"]
    assert harness["config"] == cfg.harness.key_dict() == res1["settings"]["harness"]
    assert harness["config"]["batch_size"] == 4 and harness["config"]["fewshot_seed"] == 1234
    mc = harness["tasks"]["tiny_mc"]
    assert stats1["tiny_mc/acc"] == mc["metrics"]["acc"] and stats1["tiny_mc/acc_stderr"] == mc["stderr"]["acc"] > 0
    assert stats1["tiny_docs/bits_per_byte"] == harness["tasks"]["tiny_docs"]["metrics"]["bits_per_byte"]
    assert stats1["harness_items"] == 48 + 12 + 1 and stats1["harness_items_per_s"] > 0 and stats1["harness_seconds"] > 0
    table = next(r.payload for r in ctx1.reports if r.kind == "table")
    row = next(r for r in table if r["metric"] == "tiny_mc/acc")
    assert row["this"] == mc["metrics"]["acc"] and row["stderr"] == mc["stderr"]["acc"]
    # timings are measurements of this run: manifest stats only, never results.json
    assert "timings" not in res1["metrics"] and "seconds" not in res1
    assert "seconds" not in res1["metrics"]["generations"][0]
    assert stats1["generation_tokens_per_s"] > 0 and stats1["lm_seconds"] >= 0 and stats1["seconds"] > 0
    md_report = next(r for r in ctx1.reports if r.kind == "stats-markdown")  # the store's history: stats only
    md1 = stats1[md_report.payload]
    assert "No previous evaluation" in md1 and "| perplexity |" in md1 and "The dog" in md1
    assert "| tiny_mc/acc |" in md1 and "0-shot (few-shot seed 1234), batch size 4" in md1
    fresh_store.publish("evaluate", "k1", ctx1.out, version="1", config=cfg.key_dict(),
                        inputs=ctx1.input_keys, stats=stats1, started=time.time())

    # a "newer model": the same weights saved again under another key; its table shows the first beside it
    other = tmp_path / "pretrain2"
    shutil.copytree(toy_lm.pretrain, other)
    ctx2 = make_ctx(fresh_store, cfg, {**inputs, "model": other}, fresh_store.new_tmp_dir("evaluate", "k2"), "k2")
    stats2 = run_evaluate(ctx2)
    assert stats2["previous_key"] == "k1"
    assert stats2["perplexity_change"] == pytest.approx(0.0, abs=1e-6)
    md2 = stats2[next(r for r in ctx2.reports if r.kind == "stats-markdown").payload]
    assert "Previous evaluation: `k1`" in md2 and "different held-out data" not in md2
    assert f"{stats1['perplexity']:.4g}" in md2 or f"{stats1['perplexity']:.2f}" in md2
    # the artifact's own files hold this model's numbers only: the same for the same key in any store
    assert [r.payload for r in ctx1.reports if r.kind == "table"] == [r.payload for r in ctx2.reports
                                                                       if r.kind == "table"]
    assert res1["metrics"] == json.loads((ctx2.out / RESULTS).read_text())["metrics"]


def test_missing_task_file_is_a_clear_error(toy_lm, fresh_store, tmp_path: Path) -> None:  # noqa: ANN001
    cfg = EvaluateConfig(max_sequences=2, prompts=[], tasks=[TaskConfig(name="x", path=str(tmp_path / "no.jsonl"))])
    ctx = make_ctx(fresh_store, cfg, {"model": toy_lm.pretrain, "tokenize": toy_lm.tokenize},
                   tmp_path / "out", "k")
    with pytest.raises(FileNotFoundError, match="evaluate.tasks: no task file"):
        run_evaluate(ctx)


def test_config_rejects_bad_values() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="greater than 0"):
        EvaluateConfig(max_sequences=0)
    with pytest.raises(ValidationError, match="letters, digits"):
        TaskConfig(name="a b", path="x.jsonl")
    with pytest.raises(ValidationError, match="Extra inputs"):
        EvaluateConfig(max_seqs=3)


def test_a_change_within_its_standard_error_is_called_noise() -> None:
    from llmpipe.evaluation.report import metric_rows

    def run(acc: float, se: float) -> dict:
        return {"overall": {}, "harness": {"tasks": {"mc": {"metrics": {"acc": acc}, "stderr": {"acc": se},
                                                             "higher_is_better": {"acc": True}}}}}

    def verdict(cur: dict, prev: dict) -> str:
        return next(r for r in metric_rows(cur, prev) if r["metric"] == "mc/acc")["verdict"]

    assert verdict(run(0.50, 0.05), run(0.55, 0.05)) == "within noise (worse)"  # 0.05 < hypot(.05, .05)
    assert verdict(run(0.40, 0.05), run(0.55, 0.05)) == "worse"
    assert verdict(run(0.60, 0.01), run(0.55, 0.01)) == "better"
