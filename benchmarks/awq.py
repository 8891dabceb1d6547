"""AWQ vs plain round-to-nearest (RTN) 4-bit, same model, same group size, same calibration and data.

Trains a small Llama on the toy corpus (real tokenizer + tokenize stages), then quantizes it twice
with llmcompressor: AWQModifier + W4 groups (ours) and the W4 groups alone (RTN: the baseline).
Both are saved as compressed-tensors checkpoints, reloaded with transformers, and scored by the same
``evaluate_model`` on the held-out split. A third row, our own fake-quant RTN in torch, cross-checks
the RTN number. The metric is the share of RTN's perplexity loss that AWQ wins back:

    gain = (ppl_rtn - ppl_awq) / (ppl_rtn - ppl_fp)      1 = lossless, 0 = no better than RTN

Usage: python benchmarks/awq.py [--size small|medium] [--steps N] [--group-size G]
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# benchmarks/ holds scripts named like stdlib modules (tokenize.py): never import from it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import copy  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

SIZES = {"small": dict(hidden=128, intermediate=256, layers=2, steps=150, n_docs=600),
         "medium": dict(hidden=256, intermediate=512, layers=4, steps=300, n_docs=2000)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--calibration", type=int, default=64, help="calibration sequences")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.calibration = 10, 4  # a few train steps, a few calibration sequences
    torch.set_num_threads(args.threads)

    from llmpipe.evaluation.data import load_sequences
    from llmpipe.evaluation.metrics import evaluate_model, token_byte_lengths
    from llmpipe.evaluation.model_io import checkpoint_bytes, load_model, load_tokenizer
    from llmpipe.quantization.awq import awq_quantize, calibration_dataset, rtn_quantize_
    from llmpipe.quantization.config import QuantizeConfig
    from llmpipe.quantization.stage import calibration_sample
    from tests.fixtures import toy_model as toy

    size = dict(SIZES[args.size])
    if args.steps:
        size["steps"] = args.steps
    work = Path(tempfile.mkdtemp(prefix="llmpipe-awq-bench-"))
    try:
        t0 = time.perf_counter()
        art = toy.build(work, seq_len=64, **size)
        print(f"model: hidden {size['hidden']}, {size['layers']} layers, {size['steps']} steps, "
              f"train loss {art.final_loss:.3f} ({time.perf_counter() - t0:.1f}s)")
        cpu = torch.device("cpu")
        tok = load_tokenizer(art.pretrain)
        seqs, names, _ = load_sequences(art.tokenize, "val")
        blen = token_byte_lengths(tok)

        def ppl(model: torch.nn.Module) -> float:
            return evaluate_model(model, tok, seqs, byte_len=blen, language_names=names)["overall"]["perplexity"]

        cfg = QuantizeConfig(group_size=args.group_size, calibration={"samples": args.calibration})
        calib = calibration_sample(art.tokenize, cfg)
        data = calibration_dataset([r[r >= 0] for r in calib], tok.pad_token_id)
        fp = load_model(art.pretrain, cpu)
        rows = {"fp": (ppl(fp), 0.0, checkpoint_bytes(art.pretrain))}
        for name, use_awq in (("rtn (llmcompressor)", False), ("awq (ours)", True)):
            out = work / name.split()[0]
            info = awq_quantize(art.pretrain, out, cfg, data, awq=use_awq)
            rows[name] = (ppl(load_model(out, cpu)), info["quantize_seconds"], checkpoint_bytes(out))
        own = copy.deepcopy(fp)
        t1 = time.perf_counter()
        rtn_quantize_(own, info["group_size"])
        rows["rtn (torch, fake-quant)"] = (ppl(own), time.perf_counter() - t1, 0)

        print(f"held-out: {sum(len(s.tokens) for s in seqs)} tokens; group size {info['group_size']}; "
              f"calibration {info['calibration_sequences']} sequences / {info['calibration_tokens']} tokens")
        print(f"{'model':<26}{'perplexity':>12}{'vs fp':>10}{'quant s':>10}{'bytes':>10}")
        base = rows["fp"][0]
        for name, (p, secs, nbytes) in rows.items():
            print(f"{name:<26}{p:>12.5f}{p / base - 1:>+10.3%}{secs:>10.2f}{nbytes or '-':>10}")
        p_fp, p_rtn, p_awq = base, rows["rtn (llmcompressor)"][0], rows["awq (ours)"][0]
        loss_rtn = p_rtn - p_fp
        gain = (p_rtn - p_awq) / loss_rtn if loss_rtn > 0 else 0.0
        print(f"AWQ recovers {gain:.1%} of RTN's perplexity loss; AWQ/RTN quantization time "
              f"{rows['awq (ours)'][1] / max(1e-9, rows['rtn (llmcompressor)'][1]):.1f}x")
        print(f"RESULT awq_ppl_gain_vs_rtn {gain:.3f} goal > 0")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
