"""AWQ W4 on CPU through the quantize stage: reload with plain transformers, 4-bit check, quality gate."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from llmpipe.evaluation.config import EvaluateConfig
from llmpipe.evaluation.stage import run_evaluate
from llmpipe.executor import LocalExecutor
from llmpipe.quantization.awq import (
    cpu_calibration_fix,
    distinct_values_per_group,
    effective_group_size,
    rtn_quantize_,
)
from llmpipe.quantization.config import GateConfig, QuantizeConfig
from llmpipe.quantization.gate import QualityGateError, check_gate
from llmpipe.quantization.stage import array_sha256, run_quantize
from llmpipe.stage import STAGES, StageContext


def ctx_for(name: str, cfg, inputs: dict[str, Path], out: Path, store) -> StageContext:  # noqa: ANN001
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(spec=STAGES[name], config=cfg, pipeline=None, key=f"k-{name}-{out.name}", out=out,
                        inputs=inputs, input_keys={k: f"key-{k}" for k in inputs}, store=store,
                        executor=LocalExecutor(1))


@pytest.fixture(scope="module")
def evaluated(toy_lm, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    from llmpipe.store import ArtifactStore

    root = tmp_path_factory.mktemp("quant")
    store = ArtifactStore(root / "store")
    ev = root / "evaluate"
    cfg = EvaluateConfig(max_sequences=None, prompts=["The cat"], max_new_tokens=8,
                         harness={"tasks": ["tiny_mc", "tiny_docs"]})
    run_evaluate(ctx_for("evaluate", cfg,
                         {"model": toy_lm.pretrain, "tokenize": toy_lm.tokenize}, ev, store))
    return root, store, {"model": toy_lm.pretrain, "tokenize": toy_lm.tokenize, "evaluate": ev}


@pytest.fixture(scope="module")
def awq_run(evaluated):  # noqa: ANN001, ANN201
    root, store, inputs = evaluated
    ctx = ctx_for("quantize", QuantizeConfig(calibration={"samples": 32}), inputs, root / "awq", store)
    stats = run_quantize(ctx)
    return ctx, stats


def test_awq_checkpoint_reloads_with_plain_transformers_and_passes_gate(awq_run) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ctx, stats = awq_run
    res = json.loads((ctx.out / "results.json").read_text())
    assert stats["gate_passed"] and res["gate"]["passed"]
    assert res["quantization"]["group_size"] == 128 and res["quantization"]["bits"] == 4
    conf = json.loads((ctx.out / "model" / "config.json").read_text())["quantization_config"]
    assert conf["quant_method"] == "compressed-tensors" and conf["ignore"] == ["lm_head"]
    assert conf["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    # no llmpipe code on this path: what a downstream user (or vLLM's loader) sees
    model = AutoModelForCausalLM.from_pretrained(str(ctx.out / "model"))
    tok = AutoTokenizer.from_pretrained(str(ctx.out / "model"))
    ids = tok("The cat", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 5
    assert stats["quantized_bytes"] < 0.6 * stats["fp_bytes"]
    assert stats["quantized_tokens_per_s"] > 0 and stats["fp_tokens_per_s"] > 0
    assert stats["quantize_seconds"] > 0 and stats["speedup"] > 0
    # speeds are stats (measurements of this run), never results.json
    assert "quantize_seconds" not in res["quantization"] and "timings" not in res["quantized_metrics"]
    assert all("tokens_per_s" not in row for row in res["comparison"])
    assert abs(stats["ppl_increase"]) < 0.02


def test_awq_weights_are_four_bit_after_decompression(awq_run, toy_lm) -> None:  # noqa: ANN001
    from llmpipe.evaluation.model_io import load_model

    ctx, stats = awq_run
    q = load_model(ctx.out / "model", torch.device("cpu"))
    distinct = distinct_values_per_group(q, 128, ["lm_head"])
    assert len(distinct) == 2 * 7 and max(distinct.values()) <= 16
    assert stats["max_distinct_values_per_group"] == max(distinct.values())
    fp = load_model(toy_lm.pretrain, torch.device("cpu"))
    assert max(distinct_values_per_group(fp, 128, ["lm_head"]).values()) > 100  # the check can fail
    assert torch.equal(q.lm_head.weight, fp.lm_head.weight)  # lm_head excluded


def test_calibration_sample_is_pinned_in_the_artifact(awq_run, toy_lm) -> None:  # noqa: ANN001
    from llmpipe.evaluation.model_io import load_tokenizer

    ctx, stats = awq_run
    pad = load_tokenizer(toy_lm.pretrain).pad_token_id
    calib = np.load(ctx.out / "calibration.npy")
    assert calib.shape[0] == 32 == stats["calibration_sequences"]
    assert array_sha256(calib) == stats["calibration_sha256"]
    assert stats["calibration_tokens"] == int(((calib >= 0) & (calib != pad)).sum())


# Which way 4-bit moves this toy model's perplexity depends on the run that trained it: asymmetric AWQ
# moved it a few hundredths of a percent either way, symmetric rose 0.09% on one run and fell 0.02%
# on another. So the gate is judged on the real numbers in both directions, and the stage's refusal
# is shown against a reference the quantized model cannot meet.
STRICT = {"symmetric": True, "calibration": {"samples": 2}}


def test_gate_with_threshold_zero_judges_the_real_numbers(evaluated) -> None:  # noqa: ANN001
    root, store, inputs = evaluated
    ctx = ctx_for("quantize", QuantizeConfig(**STRICT), inputs, root / "awq-symmetric", store)
    run_quantize(ctx)
    res = json.loads((ctx.out / "results.json").read_text())
    fp_m, q_m = res["fp_metrics"], res["quantized_metrics"]
    fp, q = fp_m["overall"]["perplexity"], q_m["overall"]["perplexity"]
    assert q != fp  # 4-bit weights change the numbers
    better, worse = (fp_m, q_m) if q > fp else (q_m, fp_m)  # the direction perplexity rose fails a zero allowance
    with pytest.raises(QualityGateError) as e:
        check_gate(better, worse, GateConfig(max_ppl_increase=0.0))
    assert f"{fp:.4f}" in str(e.value) and f"{q:.4f}" in str(e.value)
    verdict = check_gate(worse, better, GateConfig(max_ppl_increase=0.0))  # the other direction passes it
    assert verdict["passed"] and verdict["checks"][0]["change"] < 0
    # a harness metric, computed the same way for both models: the same tasks under the same config
    assert q_m["harness"]["config"] == fp_m["harness"]["config"] and q_m["harness"]["tasks"]["tiny_docs"]["samples"] == 12
    # what the issue says of a 1-point limit on tens of items: 4-bit flips an item or two of tiny_mc
    # (2 points each) inside its standard error (~7 points); the gate reports which
    mc = check_gate(fp_m, q_m, GateConfig(enabled=False, max_ppl_increase=1.0, metrics={"tiny_mc/acc": -0.0}))
    assert mc["checks"][-1]["stderr"] > abs(mc["checks"][-1]["change"]) or mc["checks"][-1]["noise"] == "beyond noise"
    name = "tiny_docs/bits_per_byte"
    fp_b, q_b = (m["harness"]["tasks"]["tiny_docs"]["metrics"]["bits_per_byte"] for m in (fp_m, q_m))
    assert q_b != fp_b
    better, worse = (fp_m, q_m) if q_b > fp_b else (q_m, fp_m)
    with pytest.raises(QualityGateError, match=rf"{name} moved \+.*allowed at most \+0%"):
        check_gate(better, worse, GateConfig(max_ppl_increase=1.0, metrics={name: "+0%"}))
    assert check_gate(worse, better, GateConfig(max_ppl_increase=1.0, metrics={name: "+0%"}))["passed"]


@pytest.mark.slow
def test_stage_with_threshold_zero_raises_before_publishing(evaluated, tmp_path: Path) -> None:  # noqa: ANN001
    import shutil

    root, store, inputs = evaluated
    reference = tmp_path / "evaluate"  # the evaluate artifact, with an fp perplexity no 4-bit model meets
    shutil.copytree(inputs["evaluate"], reference)
    res = json.loads((reference / "results.json").read_text())
    res["metrics"]["overall"]["perplexity"] /= 2
    (reference / "results.json").write_text(json.dumps(res))
    cfg = QuantizeConfig(**STRICT, gate={"max_ppl_increase": 0.0})
    ctx = ctx_for("quantize", cfg, {**inputs, "evaluate": reference}, root / "awq-strict", store)
    with pytest.raises(QualityGateError, match=r"perplexity rose \+.*fp \d\.\d{4} -> quantized \d\.\d{4}"):
        run_quantize(ctx)
    assert not (ctx.out / "results.json").exists()


def test_a_gate_on_a_harness_metric_at_zero_stops_the_release(evaluated, tmp_path: Path) -> None:  # noqa: ANN001
    import shutil

    root, store, inputs = evaluated
    reference = tmp_path / "evaluate"  # fp whole-document bits per byte no 4-bit model meets
    shutil.copytree(inputs["evaluate"], reference)
    res = json.loads((reference / "results.json").read_text())
    res["metrics"]["harness"]["tasks"]["tiny_docs"]["metrics"]["bits_per_byte"] /= 2
    (reference / "results.json").write_text(json.dumps(res))
    cfg = QuantizeConfig(scheme="int8_dynamic", gate={"metrics": {"tiny_docs/bits_per_byte": "+0%"}})
    ctx = ctx_for("quantize", cfg, {**inputs, "evaluate": reference}, root / "int8-strict", store)
    with pytest.raises(QualityGateError, match=r"tiny_docs/bits_per_byte moved \+\d+.*% \(fp \d\.\d{4} -> quantized "
                                               r"\d+\.\d{4}\); allowed at most \+0% \(no standard error\)"):
        run_quantize(ctx)
    assert not (ctx.out / "results.json").exists()


def test_int8_dynamic_scheme(evaluated) -> None:  # noqa: ANN001
    from llmpipe.quantization.int8 import MARKER, load_for_serving

    root, store, inputs = evaluated
    ctx = ctx_for("quantize", QuantizeConfig(scheme="int8_dynamic"), inputs, root / "int8", store)
    stats = run_quantize(ctx)
    assert stats["gate_passed"] and stats["quantized_bytes"] < 0.6 * stats["fp_bytes"]
    assert json.loads((ctx.out / "model" / MARKER).read_text())["scheme"] == "int8_dynamic"
    served = load_for_serving(ctx.out / "model")
    dyn = torch.ao.nn.quantized.dynamic.Linear
    kinds = {type(m) for n, m in served.named_modules() if n.endswith(("q_proj", "down_proj"))}
    assert kinds == {dyn} and type(served.lm_head) is torch.nn.Linear


def test_gate_accuracy_drop_in_points() -> None:
    fp = {"overall": {"perplexity": 10.0}, "harness": {"tasks": {"cloze": {"metrics": {"acc": 0.80}, "source": "evaluate.tasks"}}}}
    q = {"overall": {"perplexity": 10.1}, "harness": {"tasks": {"cloze": {"metrics": {"acc": 0.78}, "source": "evaluate.tasks"}}}}
    assert check_gate(fp, q, GateConfig(max_ppl_increase=0.02, max_accuracy_drop=2.5))["passed"]
    with pytest.raises(QualityGateError, match=r"'cloze' accuracy fell 2.00 points \(fp 0.8000 -> quantized 0.7800\)"):
        check_gate(fp, q, GateConfig(max_ppl_increase=0.02, max_accuracy_drop=1.0))
    verdict = check_gate(fp, q, GateConfig(enabled=False, max_ppl_increase=0.0, max_accuracy_drop=0.0))
    assert not verdict["passed"]  # reported, not enforced


def test_effective_group_size_follows_layer_widths() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=4))
    assert effective_group_size(tiny, 128, ["lm_head"]) == 16  # 176 = 16 * 11
    assert effective_group_size(tiny, 8, ["lm_head"]) == 8
    with pytest.raises(ValueError, match="no Linear layer left"):
        effective_group_size(tiny, 128, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                         "down_proj", "lm_head"])


def test_rtn_baseline_is_four_bit_and_close() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Sequential()
    lin.add_module("proj", torch.nn.Linear(256, 32, bias=False))
    before = lin.proj.weight.detach().clone()
    rtn_quantize_(lin, 128, ignore=[])
    assert max(distinct_values_per_group(lin, 128, []).values()) <= 16
    span = before.reshape(32, 2, 128)
    step = ((span.amax(-1).clamp(min=0) - span.amin(-1).clamp(max=0)) / 15).repeat_interleave(128, -1)
    assert ((lin.proj.weight - before).abs() <= step.reshape(32, 256) / 2 + 1e-6).all()
    assert not torch.equal(lin.proj.weight, before)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the fix only applies without an accelerator")
def test_cpu_pin_memory_fix_is_narrow() -> None:
    from llmcompressor.pipelines.cache import IntermediatesCache

    original = IntermediatesCache.pin_memory
    with pytest.raises(RuntimeError, match="accelerator"):
        torch.zeros(2).pin_memory()  # what llmcompressor hits on this machine without the fix
    with cpu_calibration_fix() as patched:
        assert patched and IntermediatesCache.pin_memory is not original
    assert IntermediatesCache.pin_memory is original


def test_sha_of_calibration_depends_on_content() -> None:
    a = np.arange(6).reshape(2, 3)
    b = copy.deepcopy(a)
    b[1, 2] = -1
    assert array_sha256(a) != array_sha256(b)
    assert array_sha256(a) == hashlib.sha256(a.tobytes() + str(a.shape).encode()).hexdigest()



def test_the_real_checkpoint_passes_the_vllm_serving_check(awq_run) -> None:  # noqa: ANN001
    from llmpipe.quantization.readiness import check_checkpoint, checkpoint_quantization
    from llmpipe.serving.config import DeployConfig

    ctx, stats = awq_run
    model = ctx.out / "model"
    scheme, group, ignore = checkpoint_quantization(model)  # read from what llmcompressor wrote
    assert (scheme, group) == ("awq_w4", stats["group_size"]) == ("awq_w4", 128) and "lm_head" in ignore
    # hidden 128 / intermediate 256 at groups of 128: Marlin's tiles, so vLLM would serve it (no raise)
    check_checkpoint(model, DeployConfig(target="gpu", backend="vllm"))
    check_checkpoint(model, DeployConfig())


@pytest.mark.parametrize(("duo", "least"), [(False, 2), (True, 3), ("both", 4)])
def test_a_grid_too_small_for_the_scale_search_is_refused_by_the_config(duo, least) -> None:  # noqa: ANN001
    from pydantic import ValidationError

    QuantizeConfig(duo_scaling=duo, n_grid=least)
    with pytest.raises(ValidationError, match=rf"n_grid must be >= {least} with duo_scaling"):
        QuantizeConfig(duo_scaling=duo, n_grid=least - 1)
