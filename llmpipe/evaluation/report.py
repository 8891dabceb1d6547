"""Markdown for the evaluation report: this model's numbers beside the previous evaluated model's."""

from __future__ import annotations

import math
from typing import Any

# (label, path into results["metrics"], lower is better)
_ROWS = [
    ("perplexity", ("overall", "perplexity"), True),
    ("bits per byte", ("overall", "bits_per_byte"), True),
    ("next-token accuracy", ("overall", "accuracy"), False),
    ("loss (nats/token)", ("overall", "loss"), True),
    ("generation tokens/s", ("generation_tokens_per_s",), False),
]


def _get(d: dict[str, Any] | None, path: tuple[str, ...]) -> float | None:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def _fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"


def metric_rows(cur: dict[str, Any], prev: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per metric (overall, per language, per task): this, previous, change."""
    paths = list(_ROWS)
    langs = sorted(set(cur.get("per_language", {})) | set((prev or {}).get("per_language", {})))
    for lang in langs:
        paths.append((f"{lang}: perplexity", ("per_language", lang, "perplexity"), True))
        paths.append((f"{lang}: bits per byte", ("per_language", lang, "bits_per_byte"), True))
    tasks = sorted(set(cur.get("tasks", {})) | set((prev or {}).get("tasks", {})))
    for t in tasks:
        paths.append((f"task {t}: acc", ("tasks", t, "acc"), False))
        paths.append((f"task {t}: acc_norm", ("tasks", t, "acc_norm"), False))
    rows = []
    for label, path, lower_better in paths:
        a, b = _get(cur, path), _get(prev, path)
        delta = a - b if a is not None and b is not None else None
        verdict = ""
        if delta is not None and delta != 0 and not math.isnan(delta):
            verdict = "better" if (delta < 0) == lower_better else "worse"
        rows.append({"metric": label, "this": a, "previous": b, "change": delta, "verdict": verdict})
    return rows


def regression_markdown(cur: dict[str, Any], prev: dict[str, Any] | None, prev_key: str | None,
                        same_data: bool) -> str:
    """The report: metric table against the previous evaluation, then the greedy samples."""
    lines = []
    if prev is None:
        lines.append("_No previous evaluation in the store: nothing to compare with._\n")
    else:
        lines.append(f"Previous evaluation: `{(prev_key or '')[:12]}`"
                     + ("" if same_data else " (**different held-out data**: compare bits per byte, "
                                             "not perplexity)") + "\n")
    lines += ["| metric | this model | previous | change | |", "| --- | ---: | ---: | ---: | --- |"]
    for r in metric_rows(cur, prev):
        ch = "–" if r["change"] is None else f"{r['change']:+.4g}"
        lines.append(f"| {r['metric']} | {_fmt(r['this'])} | {_fmt(r['previous'])} | {ch} | {r['verdict']} |")
    gens = cur.get("generations") or []
    if gens:
        lines += ["", "**Greedy samples**", "", "| prompt | completion |", "| --- | --- |"]
        for g in gens:
            comp = g["completion"].replace("|", "\\|").replace("\n", " ⏎ ")
            lines.append(f"| {g['prompt']!r} | {comp} |")
    return "\n".join(lines) + "\n"
