"""The quality gate: the quantized model may not be worse than the fp model by more than configured.

Both sides come from the same code with the same settings: the evaluate artifact's results (fp) and
``run_suite`` on the quantized model with the settings recorded there, harness tasks included. A
task metric comes with its standard error; a change no bigger than the standard error of the
difference (``hypot(se_fp, se_quantized)``, conservative on the same items) is reported as within
noise, so a failure inside sampling noise says so rather than passing silently.
"""

from __future__ import annotations

import math
from typing import Any

from llmpipe.quantization.config import OVERALL_METRICS, GateConfig, parse_allowance


class QualityGateError(RuntimeError):
    """The quantized model failed the gate; the release flow stops before deployment."""


def _harness_tasks(metrics: dict[str, Any]) -> dict[str, Any]:
    return (metrics.get("harness") or {}).get("tasks", {})


def check_gate(fp: dict[str, Any], quant: dict[str, Any], cfg: GateConfig) -> dict[str, Any]:
    """Compare two ``evaluate_model`` results; return the verdict, raise :class:`QualityGateError` on failure.

    Perplexity may rise by at most ``max_ppl_increase`` (relative); each ``evaluate.tasks`` file's
    accuracy may fall by at most ``max_accuracy_drop`` percentage points; each ``gate.metrics`` entry
    is judged by :func:`metric_check`. Every failure is named with both numbers.
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
        if t.get("source") != "evaluate.tasks":  # harness tasks are gated by name: gate.metrics
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
    checks += [metric_check(name, value, fp, quant) for name, value in cfg.metrics.items()]
    failed = [c for c in checks if not c["passed"]]
    verdict = {"passed": not failed, "enabled": cfg.enabled, "checks": checks}
    if failed and cfg.enabled:
        raise QualityGateError("quality gate failed: " + "; ".join(c["message"] for c in failed))
    return verdict


def _lookup(res: dict[str, Any], metric: str, side: str) -> tuple[float, float | None, bool]:
    """(value, standard error or None, lower is better) of ``metric`` in one model's results."""
    if metric in OVERALL_METRICS:
        return float(res["overall"][metric]), None, OVERALL_METRICS[metric]
    task, name = metric.split("/")
    if task == "documents" and name in OVERALL_METRICS and name != "accuracy":  # whole-document figures
        if "documents" not in res:
            raise ValueError(f"quantize.gate.metrics.{metric}: the {side} results hold no document-level "
                             "metrics (set evaluate.documents > 0)")
        return float(res["documents"][name]), None, OVERALL_METRICS[name]
    tasks = _harness_tasks(res)
    if task not in tasks or name not in tasks[task]["metrics"]:
        known = sorted(f"{t}/{m}" for t, v in tasks.items() for m in v["metrics"])
        raise ValueError(f"quantize.gate.metrics.{metric}: no such metric in the {side} results "
                         f"(harness metrics: {known}; set evaluate.harness.tasks to add tasks)")
    t = tasks[task]
    value = t["metrics"][name]
    if value is None:
        raise ValueError(f"quantize.gate.metrics.{metric}: the harness gave no value on the {side} model")
    return float(value), (t.get("stderr") or {}).get(name), not t.get("higher_is_better", {}).get(name, True)


def _is_accuracy(metric: str) -> bool:
    name = metric.split("/")[-1]
    return name.startswith("acc") or name in ("accuracy", "exact_match")


def metric_check(metric: str, allowance: str | float, fp: dict[str, Any], quant: dict[str, Any]) -> dict[str, Any]:
    """One ``gate.metrics`` entry judged on both models' results, with its noise."""
    a, se_a, lower = _lookup(fp, metric, "fp")
    b, se_b, _ = _lookup(quant, metric, "quantized")
    amount, relative, sign = parse_allowance(metric, allowance)
    worse = 1 if lower else -1  # the direction in which the metric gets worse
    if sign and sign != worse:
        raise ValueError(f"quantize.gate.metrics.{metric}: {'lower' if lower else 'higher'} is better, so its "
                         f"allowance is a {'rise' if lower else 'fall'}: write {'+' if lower else '-'}{amount:g}"
                         f"{'%' if relative else ''}")
    points = _is_accuracy(metric) and not relative
    allowed = amount / 100 * abs(a) if relative else amount / 100 if points else amount
    change = b - a
    noise = math.hypot(se_a, se_b) if se_a is not None and se_b is not None else None
    within = noise is not None and abs(change) <= noise
    unit = "%" if relative else " points" if points else ""
    scale = (100 / abs(a) if a else math.inf) if relative else 100 if points else 1  # to the allowance's units
    passed = bool(change * worse <= allowed + 1e-12 * max(1.0, abs(a)))
    note = ("no standard error" if noise is None else
            f"within noise: |change| <= its standard error {noise * scale:.4g}{unit}" if within else
            f"beyond its standard error {noise * scale:.4g}{unit}")
    shown = change * scale
    return {"check": metric, "fp": a, "quantized": b, "change": change, "limit": allowance, "passed": passed,
            "stderr": noise, "noise": "within noise" if within else ("beyond noise" if noise is not None else None),
            "message": (f"{metric} moved {shown:+.4g}{unit} (fp {a:.4f} -> quantized {b:.4f}); allowed at most "
                        f"{'+' if lower else '-'}{amount:g}{unit} ({note})")}
