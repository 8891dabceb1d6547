"""The pipeline's exported models are what Hugging Face tools expect: loaded, generated, stopped at end-of-text.

On the artifacts ``llmpipe run configs/tiny.yaml`` published (conftest.py), never a hand-built model:
``config.json`` and ``generation_config.json`` name the tokenizer's own bos / eos / pad ids and turn the
KV cache on; the tokenizer's ``model_max_length`` is the model's positions; the chat template renders;
``generate`` stops at end-of-text. The quantize (AWQ) artifact carries the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmpipe.tokenization.layout import TOKENIZER
from tests.unit.interop.conftest import end_of_document_prompts

PROMPTS = ["The ", "Der ", "def main("]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # other test processes share the cores


def _ids(d: Path) -> dict[str, int | None]:
    meta = json.loads((d / TOKENIZER.meta).read_text())
    return {"bos_token_id": meta["bos_id"], "eos_token_id": meta["eos_id"], "pad_token_id": meta["pad_id"]}


@pytest.mark.parametrize("which", ["pretrain", "quantize"])
def test_config_names_the_tokenizers_ids_and_lengths_agree(which: str, artifacts: dict[str, Path],
                                                           pretrain_dir: Path, quantize_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    d = {"pretrain": pretrain_dir, "quantize": quantize_dir}[which]
    want = _ids(artifacts["tokenizer"])  # what the tokenizer stage trained: eos 0, pad 1
    tok = AutoTokenizer.from_pretrained(d)
    assert {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id} == want
    assert want["eos_token_id"] != want["pad_token_id"]
    cfg = AutoConfig.from_pretrained(d)
    assert {k: getattr(cfg, k) for k in want} == want
    assert cfg.use_cache is True
    gen = GenerationConfig.from_pretrained(d)
    assert {k: getattr(gen, k) for k in want} == want
    assert tok.model_max_length == cfg.max_position_embeddings == 512
    long = tok("word " * 2000, truncation=True).input_ids
    assert len(long) == cfg.max_position_embeddings


def test_tiny_shapes_are_vllm_cpu_kernel_shapes(pretrain_dir: Path, quantize_dir: Path) -> None:
    """Head size 32 (vLLM's CPU attention refuses 16), every Linear width a multiple of 32 and an even
    group size (vLLM's CPU W4A16 kernel, CPUWNA16): quantize.group_size 128 was lowered to 64, not 16."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(pretrain_dir)
    assert cfg.hidden_size <= 128 and cfg.hidden_size // cfg.num_attention_heads == 32
    assert cfg.hidden_size % 32 == 0 and cfg.intermediate_size % 32 == 0
    qcfg = json.loads((quantize_dir / "config.json").read_text())["quantization_config"]
    assert [g["weights"]["group_size"] for g in qcfg["config_groups"].values()] == [64]


def test_chat_template_renders_with_the_exported_tokenizer(pretrain_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pretrain_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == f"<|user|>\nHello{tok.eos_token}<|assistant|>\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                  return_dict=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>") and tok.eos_token_id in ids


@pytest.mark.parametrize("which", ["pretrain", "quantize"])
def test_generate_uses_the_cache_and_stops_at_end_of_text(which: str, artifacts: dict[str, Path],
                                                          pretrain_dir: Path, quantize_dir: Path) -> None:
    """Held-out documents' last tokens as prompts: where the model's greedy next token is end-of-text,
    ``generate`` (its own generation_config, nothing passed) stops right there; elsewhere it runs to
    ``max_new_tokens``. With the old config (eos 2, a byte) it ran past end-of-text every time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = {"pretrain": pretrain_dir, "quantize": quantize_dir}[which]
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    stopped = 0
    for prompt in end_of_document_prompts(artifacts["tokenize"], eos, 12):
        x = torch.tensor([prompt])
        with torch.no_grad():
            nxt = int(model(x).logits[0, -1].argmax())
            out = model.generate(x, max_new_tokens=8, do_sample=False)
        new = out[0, len(prompt):].tolist()
        if nxt == eos:
            assert new == [eos], new  # stopped at end-of-text, nothing after it
            stopped += 1
        else:
            assert new[0] == nxt and (len(new) == 8 or new[-1] == eos), new  # ends at eos or at the budget
            assert eos not in new[:-1], new
    assert stopped >= 1, "no held-out document end where the model predicts end-of-text"
    for p in PROMPTS:  # plain prompts generate too (the cache on: the config says so, generate uses it)
        enc = tok(p, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
        assert out.past_key_values is not None and out.sequences.shape[1] > enc.input_ids.shape[1]
