"""A tiny Llama checkpoint with its own byte-level BPE tokenizer, built offline (tests, benchmarks).

The serving checks need a real HF ``save_pretrained`` directory like the quantize stage's, without
the hub; this makes one in a second.
"""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "once upon a time there was a language model",
    "pipelines turn raw text into served models",
    "hello world, numbers 12345 and symbols !?",
    "sehr geehrte damen und herren, héllo wörld",
] * 20


def make_tiny_checkpoint(path: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """Save a random LlamaForCausalLM (weights N(0, 0.2): sharp logits, few greedy ties) + tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(hf_tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, bos_token_id=hf_tok.bos_token_id,
                      eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.generation_config.eos_token_id = hf_tok.eos_token_id
    model.generation_config.pad_token_id = hf_tok.pad_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    hf_tok.save_pretrained(path)
    return path
