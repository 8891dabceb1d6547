"""Markdown for the evaluation report: this model's numbers beside the unigram baseline's and the previous
evaluated model's."""

from __future__ import annotations

import math
from typing import Any

# (label, path into results["metrics"], lower is better); no timings: they are manifest stats
_ROWS = [
    ("perplexity", ("overall", "perplexity"), True),
    ("bits per byte", ("overall", "bits_per_byte"), True),
    ("next-token accuracy", ("overall", "accuracy"), False),
    ("loss (nats/token)", ("overall", "loss"), True),
    ("whole documents: bits per byte", ("documents", "bits_per_byte"), True),
    ("whole documents: perplexity", ("documents", "perplexity"), True),
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


def _ratio(metrics: dict[str, Any] | None, base: dict[str, Any] | None, path: tuple[str, ...]) -> float | None:
    a, b = _get(metrics, path), _get(base, path)
    return a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else None


def metric_rows(cur: dict[str, Any], prev: dict[str, Any] | None, base: dict[str, Any] | None = None,
                prev_base: dict[str, Any] | None = None, kn: dict[str, Any] | None = None,
                prev_kn: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per metric (overall, per language, per task): this, the unigram and the Kneser-Ney
    baselines on the same bytes (``base``, ``kn``, see :mod:`llmpipe.evaluation.baseline`), previous,
    change; and, with a baseline, one "bits per byte ÷ unigram" (÷ KN) row overall and per language
    (``prev_base``, ``prev_kn``: the previous model's)."""
    paths = list(_ROWS)
    langs = sorted(set(cur.get("per_language", {})) | set((prev or {}).get("per_language", {})))
    for lang in langs:
        paths.append((f"{lang}: perplexity", ("per_language", lang, "perplexity"), True))
        paths.append((f"{lang}: bits per byte", ("per_language", lang, "bits_per_byte"), True))
    if "entities" in cur or "entities" in (prev or {}):  # the entity loss's effect, beside the overall
        paths.append(("entity targets: accuracy", ("entities", "accuracy"), False))
        paths.append(("entity targets: bits per byte", ("entities", "bits_per_byte"), True))
    values = [(label, _get(cur, path), _get(prev, path), _get(base, path), lower, _get(kn, path))
              for label, path, lower in paths if _get(cur, path) is not None or _get(prev, path) is not None]
    harness = harness_rows(cur, prev)
    if base is not None:  # the ratio rows: overall right under bits per byte, per language after the rest

        def ratio_row(prefix: str, path: tuple[str, ...], b: Any = base, pb: Any = prev_base,
                      name: str = "unigram") -> tuple[str, Any, Any, None, bool, None]:
            return f"{prefix}bits per byte ÷ {name}", _ratio(cur, b, path), _ratio(prev, pb, path), None, True, None

        at = 1 + next(i for i, v in enumerate(values) if v[0] == "bits per byte")
        values.insert(at, ratio_row("", ("overall", "bits_per_byte")))
        if kn is not None:
            values.insert(at + 1, ratio_row("", ("overall", "bits_per_byte"), kn, prev_kn, "Kneser-Ney"))
            if "documents" in kn:
                values.append(ratio_row("whole documents: ", ("documents", "bits_per_byte"), kn, prev_kn,
                                        "Kneser-Ney"))
        values += [ratio_row(f"{lang}: ", ("per_language", lang, "bits_per_byte")) for lang in langs]
    rows = []
    for label, a, b, u, lower_better, k, *se in [*values, *harness]:
        delta = a - b if a is not None and b is not None else None
        noise = _delta_stderr(*se) if se else None
        verdict = ""
        if delta is not None and delta != 0 and not math.isnan(delta):
            verdict = "better" if (delta < 0) == lower_better else "worse"
            if noise is not None and abs(delta) <= noise:
                verdict = f"within noise ({verdict})"
        rows.append({"metric": label, "this": a, "stderr": se[0] if se else None, "unigram": u, "kn": k, "previous": b,
                     "change": delta, "verdict": verdict})
    return rows


def _delta_stderr(a: float | None, b: float | None) -> float | None:
    """Standard error of the difference of two independent estimates: sqrt(a^2 + b^2) (conservative
    for two models scored on the same items, whose errors are correlated)."""
    return math.hypot(a, b) if a is not None and b is not None else None


def harness_rows(cur: dict[str, Any], prev: dict[str, Any] | None) -> list[tuple[Any, ...]]:
    """(label, this, previous, unigram, lower is better, KN, this stderr, previous stderr) per harness
    task metric (``task/metric``), so a change smaller than its noise is called so."""
    tasks = {**((prev or {}).get("harness") or {}).get("tasks", {}), **(cur.get("harness") or {}).get("tasks", {})}
    out = []
    for t in sorted(tasks):
        for m in tasks[t]["metrics"]:
            lower = not tasks[t].get("higher_is_better", {}).get(m, True)
            val, se = ("harness", "tasks", t, "metrics", m), ("harness", "tasks", t, "stderr", m)
            out.append((f"{t}/{m}", _get(cur, val), _get(prev, val), None, lower, None, _get(cur, se), _get(prev, se)))
    return out


def regression_markdown(cur: dict[str, Any], prev: dict[str, Any] | None, prev_key: str | None,
                        same_data: bool, base: dict[str, Any] | None = None,
                        prev_base: dict[str, Any] | None = None, kn: dict[str, Any] | None = None,
                        prev_kn: dict[str, Any] | None = None) -> str:
    """The report: the model against the unigram baseline and the previous evaluation, then the
    greedy samples."""
    lines = []
    ratio = _ratio(cur, base, ("overall", "bits_per_byte"))
    if ratio is not None:
        lines.append(f"Held-out bits per byte: this model {_fmt(_get(cur, ('overall', 'bits_per_byte')))}, "
                     f"a unigram model of the {base.get('train_tokens', '?')} training tokens "
                     f"{_fmt(_get(base, ('overall', 'bits_per_byte')))} on the same bytes: "
                     f"**{ratio:.3f}** of it (1.0: nothing learnt beyond token frequencies).\n")
    kn_ratio = _ratio(cur, kn, ("overall", "bits_per_byte"))
    if kn_ratio is not None:
        lines.append(f"An {kn.get('smoothing', 'n-gram')} model of {kn.get('train_tokens', '?')} training tokens: "
                     f"{_fmt(_get(kn, ('overall', 'bits_per_byte')))} bits per byte on the same bytes, the model "
                     f"**{kn_ratio:.3f}** of it (below 1.0: the model beats a classic n-gram model).\n")
    docs = cur.get("documents")
    if docs:
        lines.append(f"Whole documents ({docs['documents']} of {docs.get('documents_total', '?')} held-out, "
                     f"rolling windows of {docs['window']} tokens, stride {docs['stride']}): "
                     f"{_fmt(docs['bits_per_byte'])} bits per byte (packed windows: "
                     f"{_fmt(_get(cur, ('overall', 'bits_per_byte')))}).\n")
    if prev is None:
        lines.append("_No previous evaluation in the store: nothing to compare with._\n")
    else:
        lines.append(f"Previous evaluation: `{(prev_key or '')[:12]}`"
                     + ("" if same_data else " (**different held-out data**: compare bits per byte, "
                                             "not perplexity)") + "\n")
    h = cur.get("harness")
    if h:
        c = h["config"]
        lines.append(f"Harness tasks: lm-evaluation-harness {h['lm_eval_version']}, {c['num_fewshot']}-shot "
                     f"(few-shot seed {c['fewshot_seed']}), batch size {c['batch_size']}, dtype {c['dtype']}, "
                     f"max length {c['max_length'] or 'of the model'}, chat template {'on' if c['chat_template'] else 'off'}; "
                     "a change within the standard error of the difference is called within noise.\n")
    lines += ["| metric | this model | ± stderr | unigram | Kneser-Ney | previous | change | |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in metric_rows(cur, prev, base, prev_base, kn, prev_kn):
        ch = "–" if r["change"] is None else f"{r['change']:+.4g}"
        lines.append(f"| {r['metric']} | {_fmt(r['this'])} | {_fmt(r['stderr'])} | {_fmt(r['unigram'])} | {_fmt(r['kn'])} "
                     f"| {_fmt(r['previous'])} | {ch} | {r['verdict']} |")
    gens = cur.get("generations") or []
    if gens:
        lines += ["", "**Greedy samples**", "", "| prompt | completion |", "| --- | --- |"]
        for g in gens:
            comp = g["completion"].replace("|", "\\|").replace("\n", " ⏎ ")
            lines.append(f"| {g['prompt']!r} | {comp} |")
    return "\n".join(lines) + "\n"
