"""The quality gate: the quantized model may not be worse than the fp model by more than configured."""

from __future__ import annotations

from typing import Any

from llmpipe.quantization.config import GateConfig


class QualityGateError(RuntimeError):
    """The quantized model failed the gate; the release flow stops before deployment."""


def _harness_tasks(metrics: dict[str, Any]) -> dict[str, Any]:
    return (metrics.get("harness") or {}).get("tasks", {})


def check_gate(fp: dict[str, Any], quant: dict[str, Any], cfg: GateConfig) -> dict[str, Any]:
    """Compare two ``evaluate_model`` results; return the verdict, raise :class:`QualityGateError` on failure.

    Perplexity may rise by at most ``max_ppl_increase`` (relative); each task's accuracy may fall by
    at most ``max_accuracy_drop`` percentage points. Every failure is named with both numbers.
    """
    fp_ppl, q_ppl = fp["overall"]["perplexity"], quant["overall"]["perplexity"]
    rise = q_ppl / fp_ppl - 1.0
    checks: list[dict[str, Any]] = [{
        "check": "perplexity", "fp": fp_ppl, "quantized": q_ppl, "change": rise, "limit": cfg.max_ppl_increase,
        "passed": bool(rise <= cfg.max_ppl_increase),
        "message": (f"perplexity rose {rise:+.2%} (fp {fp_ppl:.4f} -> quantized {q_ppl:.4f}); "
                    f"allowed at most +{cfg.max_ppl_increase:.2%}"),
    }]
    fp_tasks, q_tasks = _harness_tasks(fp), _harness_tasks(quant)
    for name, t in sorted(fp_tasks.items()):
        if "acc" not in t["metrics"]:
            continue
        if name not in q_tasks:
            raise QualityGateError(f"quality gate: task {name!r} was not evaluated on the quantized model")
        a, b = t["metrics"]["acc"], q_tasks[name]["metrics"]["acc"]
        drop = (a - b) * 100.0
        checks.append({
            "check": f"task {name} acc", "fp": a, "quantized": b, "change": -drop, "limit": cfg.max_accuracy_drop,
            "passed": bool(drop <= cfg.max_accuracy_drop),
            "message": (f"task {name!r} accuracy fell {drop:.2f} points (fp {a:.4f} -> quantized {b:.4f}); "
                        f"allowed at most {cfg.max_accuracy_drop:.2f} points"),
        })
    failed = [c for c in checks if not c["passed"]]
    verdict = {"passed": not failed, "enabled": cfg.enabled, "checks": checks}
    if failed and cfg.enabled:
        raise QualityGateError("quality gate failed: " + "; ".join(c["message"] for c in failed))
    return verdict
