"""The quality gate on any metric (gate.metrics), with the noise of harness task metrics."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from llmpipe.quantization.config import GateConfig
from llmpipe.quantization.gate import QualityGateError, check_gate


def results(ppl: float, acc: float, se: float | None, bpb: float = 1.0) -> dict:
    """The shape of evaluate's metrics: overall numbers and harness tasks with standard errors."""
    return {"overall": {"perplexity": ppl, "bits_per_byte": bpb},
            "harness": {"tasks": {
                "mc": {"metrics": {"acc": acc}, "stderr": {"acc": se}, "higher_is_better": {"acc": True},
                       "source": "evaluate.tasks"},
                "docs": {"metrics": {"bits_per_byte": bpb}, "stderr": {"bits_per_byte": None},
                         "higher_is_better": {"bits_per_byte": False}}}}}


def gate(**metrics: str | float) -> GateConfig:
    return GateConfig(max_ppl_increase=1.0, max_accuracy_drop=100.0, metrics=metrics)


def test_a_harness_accuracy_with_threshold_zero_stops_the_release_and_says_it_is_noise() -> None:
    fp, q = results(10.0, 0.50, 0.07), results(10.0, 0.48, 0.07)
    with pytest.raises(QualityGateError) as e:
        check_gate(fp, q, gate(**{"mc/acc": -0.0}))
    assert "mc/acc moved -2 points (fp 0.5000 -> quantized 0.4800); allowed at most -0 points" in str(e.value)
    assert "within noise: |change| <= its standard error 9.899 points" in str(e.value)
    verdict = check_gate(fp, q, gate(**{"mc/acc": -2.5}))
    check = verdict["checks"][-1]
    assert verdict["passed"] and check["noise"] == "within noise" and check["stderr"] == pytest.approx(0.0990, abs=1e-4)
    beyond = check_gate(fp, results(10.0, 0.30, 0.01), GateConfig(enabled=False, metrics={"mc/acc": -1}))
    assert not beyond["passed"] and beyond["checks"][-1]["noise"] == "beyond noise"
    assert check_gate(q, fp, gate(**{"mc/acc": 0}))["passed"]  # a rise passes a zero allowance


def test_relative_allowances_on_overall_and_harness_metrics() -> None:
    fp, q = results(10.0, 0.5, 0.05, bpb=1.00), results(10.0, 0.5, 0.05, bpb=1.005)
    assert check_gate(fp, q, gate(bits_per_byte="+1%", **{"docs/bits_per_byte": "1%"}))["passed"]
    with pytest.raises(QualityGateError, match=r"bits_per_byte moved \+0.5%.*allowed at most \+0.2%.*no standard error"):
        check_gate(fp, q, gate(bits_per_byte="+0.2%"))
    with pytest.raises(QualityGateError, match=r"docs/bits_per_byte moved \+0.005 "):
        check_gate(fp, q, gate(**{"docs/bits_per_byte": 0.001}))


def test_bad_gate_entries_are_clear_errors() -> None:
    fp = results(10.0, 0.5, 0.05)
    with pytest.raises(ValueError, match=r"gate.metrics.mc/acc: higher is better, so its allowance is a fall: write -1"):
        check_gate(fp, fp, gate(**{"mc/acc": "+1"}))
    with pytest.raises(ValueError, match=r"gate.metrics.nope/acc: no such metric in the fp results .*'mc/acc'"):
        check_gate(fp, fp, gate(**{"nope/acc": -1}))
    with pytest.raises(ValidationError, match=r"gate.metrics.ppl: name one of"):
        GateConfig(metrics={"ppl": "+1%"})
    with pytest.raises(ValidationError, match=r"gate.metrics.mc/acc: 'one' is not an allowance"):
        GateConfig(metrics={"mc/acc": "one"})


def test_the_old_keys_still_gate() -> None:
    fp, q = results(10.0, 0.80, 0.04), results(10.3, 0.78, 0.04)
    with pytest.raises(QualityGateError, match=r"perplexity rose \+3.00%.*'mc' accuracy fell 2.00 points"):
        check_gate(fp, q, GateConfig(max_ppl_increase=0.02, max_accuracy_drop=1.0))


def test_a_gate_on_whole_document_bits_per_byte() -> None:
    fp, q = results(10.0, 0.5, 0.05), results(10.0, 0.5, 0.05)
    fp["documents"], q["documents"] = {"bits_per_byte": 1.0}, {"bits_per_byte": 1.03}
    assert check_gate(fp, q, gate(**{"documents/bits_per_byte": "+5%"}))["passed"]
    with pytest.raises(QualityGateError, match=r"documents/bits_per_byte moved \+3%"):
        check_gate(fp, q, gate(**{"documents/bits_per_byte": "+1%"}))
    with pytest.raises(ValueError, match=r"no document-level metrics \(set evaluate.documents > 0\)"):
        check_gate(results(10.0, 0.5, 0.05), q, gate(**{"documents/bits_per_byte": "+1%"}))
