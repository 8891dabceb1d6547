"""The ``quantize`` stage: AWQ W4 (or dynamic int8) of the evaluated model, behind a quality gate.

Artifact layout::

    model/              the checkpoint to deploy (compressed-tensors for AWQ; fp + marker for int8)
    calibration.npy     the calibration sample (int64 [n, len], padding = -1): pinned, hashed in results
    results.json        the gate verdict, fp vs quantized metrics, bytes on disk

Speeds (fp and quantized generation tokens/s, seconds spent quantizing) are measurements of one
run: they go to the manifest's stats (and the ``quantize-speed`` report), never into the files.

Before any work the stage checks that the model's shapes and ``quantize.group_size`` suit the
kernels of the deploy target (``llmpipe/quantization/readiness.py``: vLLM's W4A16 kernels take
groups of 32/64/128 and widths in multiples of 128; the Python backend takes any), and refuses with
the keys to change rather than publish a checkpoint that will not serve.

The gate compares against the evaluate artifact's ``results.json`` and evaluates the quantized
model with the settings recorded there, on the same held-out data. A failure raises
:class:`QualityGateError`; no artifact is published, so the release flow stops before deploy.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmpipe.evaluation.config import EvaluateConfig
from llmpipe.evaluation.layout import EVALUATE
from llmpipe.evaluation.stage import harness_modules, run_suite
from llmpipe.files import link_file
from llmpipe.quantization.config import QuantizeConfig
from llmpipe.quantization.gate import QualityGateError, check_gate
from llmpipe.quantization.layout import QUANTIZE
from llmpipe.quantization.readiness import check_before_quantizing
from llmpipe.serving.config import DeployConfig
from llmpipe.stage import MODEL, StageContext, stage

if TYPE_CHECKING:  # numpy, torch and the quantizers load when the stage runs, not when it registers
    import numpy as np
    import torch

# 3: fp and quantized metrics gain "harness"; the gate gains gate.metrics checks with stderr and noise
VERSION = "3"
TIMING_INFO = ("quantize_seconds",)  # keys of the quantizers' info that are timings, not results


def calibration_sample(tokenize_dir: Path, cfg: QuantizeConfig) -> np.ndarray:
    """Evenly spaced packed sequences of our curated data, cut to ``calibration.seq_len``; -1 pads."""
    import numpy as np

    from llmpipe.evaluation.data import evenly_spaced
    from llmpipe.training.data import open_packed

    ds: Any = open_packed(tokenize_dir, cfg.calibration.split)
    if len(ds) == 0:
        raise ValueError(f"quantize.calibration.split: split {cfg.calibration.split!r} holds no sequences")
    rows = [np.asarray(ds[i], dtype=np.int64)[: cfg.calibration.seq_len]
            for i in evenly_spaced(len(ds), cfg.calibration.samples)]
    width = max(len(r) for r in rows)
    return np.stack([np.pad(r, (0, width - len(r)), constant_values=-1) for r in rows])


def array_sha256(a: np.ndarray) -> str:
    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(a).tobytes() + str(a.shape).encode()).hexdigest()


def baseline(evaluate_dir: Path) -> tuple[dict[str, Any], EvaluateConfig]:
    """The evaluate artifact's results and the settings they were computed with."""
    path = Path(evaluate_dir) / EVALUATE.results
    if not path.is_file():
        raise FileNotFoundError(f"quantize: {path} missing; the gate needs the evaluate stage's results")
    res = json.loads(path.read_text())
    return res, EvaluateConfig(**res["settings"])


def speed(model: Any, tok: Any, ecfg: EvaluateConfig) -> float:
    from llmpipe.evaluation.metrics import generate

    prompts = ecfg.prompts or ["The "]
    return float(generate(model, tok, prompts, ecfg.max_new_tokens)["generation_tokens_per_s"])


def quantize_awq(ctx: StageContext, cfg: QuantizeConfig, fp_dir: Path, ecfg: EvaluateConfig,
                 device: torch.device, pad_id: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results of the quantized model, quantization info) for the AWQ scheme."""
    import numpy as np

    from llmpipe.evaluation.model_io import load_model, load_tokenizer
    from llmpipe.quantization.awq import awq_quantize, calibration_dataset, distinct_values_per_group

    calib = calibration_sample(ctx.inputs["tokenize"], cfg)
    np.save(ctx.out / QUANTIZE.calibration, calib)
    rows = [r[r >= 0] for r in calib]
    info = awq_quantize(fp_dir, ctx.out / QUANTIZE.checkpoint, cfg, calibration_dataset(rows, pad_id))
    info["calibration_sha256"] = array_sha256(calib)
    qdir = ctx.out / QUANTIZE.checkpoint
    model = load_model(qdir, device)  # plain transformers: proves the checkpoint reloads
    if cfg.gate.verify_bits:
        distinct = distinct_values_per_group(model, info["group_size"], cfg.ignore)
        info["max_distinct_values_per_group"] = max(distinct.values())
        bad = {n: v for n, v in distinct.items() if v > 16}
        if bad:
            raise QualityGateError(f"quality gate: weights are not 4-bit after decompression: {bad} distinct "
                                   f"values in a group of {info['group_size']} (at most 16 allowed)")
    res = run_suite(qdir, ctx.inputs["tokenize"], ecfg, device, model=model)
    res["tokens_per_s"] = _tokens_per_s(res) or speed(model, load_tokenizer(qdir), ecfg)
    return res, info


def quantize_int8(ctx: StageContext, cfg: QuantizeConfig, fp_dir: Path, ecfg: EvaluateConfig
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results, info) for dynamic int8: the checkpoint is the fp one plus a marker (see int8.py)."""
    import torch

    from llmpipe.evaluation.model_io import load_model, load_tokenizer
    from llmpipe.quantization.int8 import quantize_int8_dynamic, serialized_bytes, write_marker

    qdir = ctx.out / QUANTIZE.checkpoint
    for f in fp_dir.iterdir():
        if f.is_file():
            link_file(f, qdir / f.name)
    t0 = time.perf_counter()
    model = quantize_int8_dynamic(load_model(fp_dir, torch.device("cpu")), cfg.ignore)
    info = {"bits": 8, "quantize_seconds": round(time.perf_counter() - t0, 3), "int8_bytes": serialized_bytes(model)}
    write_marker(qdir, {"scheme": "int8_dynamic", "ignore": list(cfg.ignore), "dtype": "qint8"})
    res = run_suite(qdir, ctx.inputs["tokenize"], ecfg, torch.device("cpu"), model=model)
    res["tokens_per_s"] = _tokens_per_s(res) or speed(model, load_tokenizer(qdir), ecfg)
    return res, info


def deploy_config(ctx: StageContext) -> DeployConfig:
    """The deploy section the artifact is for (its defaults when the stage runs without a pipeline)."""
    deploy = getattr(ctx.pipeline, "deploy", None)
    return deploy if isinstance(deploy, DeployConfig) else DeployConfig()


def _tokens_per_s(res: dict[str, Any]) -> float | None:
    """Generation tokens/s of a ``run_suite`` result; its timings leave the metrics (they are stats)."""
    return res["metrics"].pop("timings", {}).get("generation_tokens_per_s")


# MODEL: the model evaluate measured (the tuned one when post-training is on; see llmpipe.stage.MODEL)
@stage("quantize", version=VERSION, inputs=(MODEL, "tokenize", "evaluate"), config_field="quantize",
       flow="release",
       extra="quantize", requires=lambda cfg: ("torch", "transformers", *harness_modules(cfg.evaluate), *(
           ("llmcompressor", "compressed_tensors") if cfg.quantize.scheme == "awq_w4" else ())))
def run_quantize(ctx: StageContext) -> dict[str, Any]:
    """AWQ 4-bit (or int8 dynamic) quantization calibrated on our data, gated on held-out quality."""
    import torch

    from llmpipe.evaluation.model_io import (
        checkpoint_bytes,
        find_checkpoint,
        load_model,
        load_tokenizer,
        resolve_device,
    )

    cfg: QuantizeConfig = ctx.config
    device = resolve_device(cfg.device)
    fp_dir = find_checkpoint(ctx.inputs[MODEL])
    # before any work: a checkpoint the deploy target's kernels cannot take fails here, not at serving
    check_before_quantizing(fp_dir, cfg, deploy_config(ctx))
    fp_res, ecfg = baseline(ctx.inputs["evaluate"])
    tok = load_tokenizer(fp_dir)
    if cfg.scheme == "awq_w4":
        q_res, info = quantize_awq(ctx, cfg, fp_dir, ecfg, device, tok.pad_token_id)
        q_bytes, q_device = checkpoint_bytes(ctx.out / QUANTIZE.checkpoint), device
    else:
        q_res, info = quantize_int8(ctx, cfg, fp_dir, ecfg)
        q_bytes, q_device = info["int8_bytes"], torch.device("cpu")
    fp_model = load_model(fp_dir, q_device)
    fp_tps = speed(fp_model, tok, ecfg)
    del fp_model
    timings = {k: info.pop(k) for k in TIMING_INFO if k in info}
    comparison = [
        {"model": "fp", "bytes_on_disk": checkpoint_bytes(fp_dir), "device": str(q_device),
         "perplexity": fp_res["metrics"]["overall"]["perplexity"]},
        {"model": cfg.scheme, "bytes_on_disk": q_bytes,
         "device": str(q_device), "perplexity": q_res["metrics"]["overall"]["perplexity"]},
    ]
    results = {"scheme": cfg.scheme, "quantization": info, "comparison": comparison,
               "fp_metrics": fp_res["metrics"], "quantized_metrics": q_res["metrics"],
               "settings": cfg.key_dict(), "evaluate_settings": ecfg.key_dict(), "inputs": dict(ctx.input_keys)}
    ctx.report_table("quantize-size", "fp vs quantized: bytes on disk, perplexity", comparison)
    ctx.report_stats("quantize-speed", "fp vs quantized: generation tokens/s",
                     ["fp_tokens_per_s", "quantized_tokens_per_s", "speedup", *timings])
    ctx.log.info("quantize: %s ppl fp %.4f -> %.4f, %d -> %d bytes", cfg.scheme, comparison[0]["perplexity"],
                 comparison[1]["perplexity"], comparison[0]["bytes_on_disk"], q_bytes)
    verdict = check_gate(fp_res["metrics"], q_res["metrics"], cfg.gate)
    results["gate"] = verdict
    ctx.report_table("quantize-gate", "Quality gate", [
        {k: c.get(k) for k in ("check", "fp", "quantized", "change", "limit", "stderr", "noise", "passed")}
        for c in verdict["checks"]])
    (ctx.out / QUANTIZE.results).write_text(json.dumps(results, indent=1, sort_keys=True, default=str))
    stats = {"scheme": cfg.scheme, "gate_passed": verdict["passed"],
             "fp_perplexity": comparison[0]["perplexity"], "quantized_perplexity": comparison[1]["perplexity"],
             "ppl_increase": verdict["checks"][0]["change"], "fp_bytes": comparison[0]["bytes_on_disk"],
             "quantized_bytes": q_bytes, "size_ratio": q_bytes / max(1, comparison[0]["bytes_on_disk"]),
             "fp_tokens_per_s": fp_tps, "quantized_tokens_per_s": q_res["tokens_per_s"],
             "speedup": q_res["tokens_per_s"] / fp_tps if fp_tps else None, **timings}
    stats.update({k: v for k, v in info.items() if isinstance(v, (int, float, str, bool))})
    return stats
