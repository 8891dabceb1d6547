"""configs/tiny-chat.yaml through the library DAG: pretrain -> sft -> preference, and the tuned folders.

The upstream stages are tiny.yaml's, key for key (the store in the repository root that ``make run``
filled serves them; a store without them runs them first, minutes). The checks are the issue's:
SFT lowers the held-out response loss, DPO raises held-out preference accuracy over the SFT model,
and each tuned folder loads with ``from_pretrained`` with its chat template and special ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.e2e.conftest import run_tiny_chat

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs() -> dict[str, object]:
    return {r.stage: r for r in run_tiny_chat(until="preference")[1]}


def test_sft_lowers_held_out_response_loss(runs: dict) -> None:
    s = runs["sft"].stats
    assert s["held_out_pairs"] >= 20
    assert s["held_out_response_loss"] < 0.7 * s["held_out_response_loss_before"], s


def test_dpo_raises_held_out_preference_accuracy(runs: dict) -> None:
    s = runs["preference"].stats
    assert s["held_out_pairs"] >= 40
    assert s["preference_accuracy"] > s["preference_accuracy_before"] + 0.2, s
    assert s["reward_margin"] > 0 and s["held_out_dpo_loss"] < s["held_out_dpo_loss_before"], s


@pytest.mark.parametrize("stage", ["sft", "preference"])
def test_the_tuned_folder_loads_with_its_template_and_ids(runs: dict, stage: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = Path(runs[stage].path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<|system|>\nBe brief.<|endoftext|><|user|>\nHi<|endoftext|><|assistant|>\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|user|>") in ids and tok.convert_tokens_to_ids("<|assistant|>") in ids
    gen = GenerationConfig.from_pretrained(path)
    for cfg in (model.config, gen):
        assert (cfg.eos_token_id, cfg.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert model.config.bos_token_id == tok.bos_token_id
    out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert out.shape[1] > len(ids)
    steps = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert steps and all("loss" in r for r in steps)


def test_a_second_run_of_one_key_gives_the_same_bytes(runs: dict, tmp_path: Path) -> None:
    """sft and preference again into an empty store from the same pretrain artifact (and without
    HF_HUB_OFFLINE, which transformers once wrote into the tokenizer's config): the same files."""
    from llmpipe.config import load_config
    from llmpipe.dag import execute, open_store, plan
    from llmpipe.store import ArtifactStore

    old = Path.cwd()
    os.chdir(ROOT)
    offline = os.environ.pop("HF_HUB_OFFLINE", None)
    try:
        cfg = load_config(ROOT / "configs" / "tiny-chat.yaml")
        planned, store, fresh = plan(cfg), open_store(cfg), ArtifactStore(tmp_path / "store")
        upstream = {"pretrain": store.get("pretrain", planned["pretrain"].key)}
        for name in ("sft", "preference"):
            art, ran, _ = execute(cfg, fresh, planned[name], upstream)
            assert ran and art.manifest["files"] == store.get(name, planned[name].key).manifest["files"], name
            upstream[name] = art
    finally:
        os.chdir(old)
        if offline is not None:
            os.environ["HF_HUB_OFFLINE"] = offline
