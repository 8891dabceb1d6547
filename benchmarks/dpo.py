"""DPO's held-out preference accuracy over the SFT model's: does preference tuning learn the preference?

Full run: ``configs/tiny-chat.yaml`` through the library DAG up to ``preference`` (its store: cached
stages are reused, so after ``llmpipe run configs/tiny-chat.yaml`` this only reads the artifacts), and
the preference stage's stats: held-out preference accuracy (the share of pairs whose chosen answer the
model finds more likely than the rejected one) of the SFT model and of the DPO model, the reward
margin, the SFT stage's held-out response loss before and after.

``--quick``: the same sft and DPO code in this process on a random tiny Llama (hidden 64) with the
project's tokenizer (``tests/fixtures/tiny_checkpoint.py``), a few steps each: proves the script works.

    python benchmarks/dpo.py [--quick] [overrides...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

# benchmarks/ holds scripts named like stdlib modules (tokenize.py): keep it off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.fixtures

from benchmarks._common import result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def full(overrides: list[str]) -> dict[str, Any]:
    from llmpipe.config import load_config
    from llmpipe.dag import run_pipeline

    cfg = load_config(ROOT / "configs" / "tiny-chat.yaml", overrides)
    runs = {r.stage: r for r in run_pipeline(cfg, until="preference")}
    sft, pref = runs["sft"].stats, runs["preference"].stats
    print(f"sft: held-out response loss {sft['held_out_response_loss_before']:.3f} -> "
          f"{sft['held_out_response_loss']:.3f} nats/token ({sft['train_pairs']} pairs, {sft['steps']} steps)")
    return pref


def quick() -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmpipe.posttrain import data, dpo, sft
    from tests.fixtures.tiny_checkpoint import make_tiny_checkpoint

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "ckpt")
        tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
        pairs, _ = data.split(data.builtin_instructions(), 0.1)
        sft.train(model, tok, pairs, steps=10, batch_size=8, lr=2e-3, weight_decay=0.0, max_length=96, seed=0)
        ref = AutoModelForCausalLM.from_pretrained(path)
        ref.load_state_dict(model.state_dict())
        ref.requires_grad_(False)
        train, held = data.split(data.builtin_preferences(), 0.2)
        ref_logps = dpo.pair_logps(ref, tok, held, 96)
        before = dpo.preference_stats(model, ref_logps, tok, held, 0.1, 96)
        dpo.make_trainer(model, ref, tok, train, out_dir=Path(tmp) / "run", steps=20, batch_size=8, lr=2e-3,
                         beta=0.1, max_length=96, seed=0).train()
        after = dpo.preference_stats(model, ref_logps, tok, held, 0.1, 96)
    return {"held_out_pairs": len(held), "preference_accuracy_before": before["accuracy"],
            "preference_accuracy": after["accuracy"], "reward_margin": after["reward_margin"],
            "preference_accuracy_gain": after["accuracy"] - before["accuracy"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="random tiny model in process, a few steps")
    ap.add_argument("overrides", nargs="*", help="config overrides for the full run (key=value)")
    args = ap.parse_args()
    s = quick() if args.quick else full(args.overrides)
    print(f"preference accuracy on {s['held_out_pairs']} held-out pairs: sft {s['preference_accuracy_before']:.3f}"
          f" -> dpo {s['preference_accuracy']:.3f}; reward margin {s['reward_margin']:.3f}")
    result("dpo_pref_accuracy_gain", s["preference_accuracy_gain"], ">", 0)


if __name__ == "__main__":
    main()
