"""Fixtures for the augment tests: tiny models built offline from configs, and a stage context."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EN = [
    "The quick brown fox jumps over the lazy dog. It was a happy day in the big city.",
    "Maria Lopez said that 42 children played in the park. They were very happy and fast.",
    "A small house stood near the old river. The people there often help each other.",
    "Paris is a beautiful city. Many people visit it every year. It has 20 districts.",
]
ZH = ["今天天气很好。我们非常高兴。孩子们在公园里玩。", "这个城市很美丽，许多人来这里旅游。老师和学生都很快乐。"]


@pytest.fixture(scope="session")
def tiny_mlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer BERT-like masked LM with a WordPiece tokenizer trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import BertConfig, BertForMaskedLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny-mlm")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(EN * 5 + ZH * 5, trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(out)
    cfg = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128)
    import torch

    torch.manual_seed(0)
    BertForMaskedLM(cfg).save_pretrained(out)
    return out


def _tiny_marian(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import MarianConfig, MarianMTModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(EN * 5 + ZH * 5, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "</s>", "<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(out)
    cfg = MarianConfig(vocab_size=tok.get_vocab_size(), d_model=32, encoder_layers=1, decoder_layers=1,
                       encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                       max_position_embeddings=128, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                       forced_eos_token_id=1)
    torch.manual_seed(len(str(out)))
    MarianMTModel(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_marian_chain(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two tiny random Marian models (say zh->en and en->zh): noise out, but the real generate path."""
    return [_tiny_marian(tmp_path_factory.mktemp(f"marian-{i}")) for i in range(2)]


@pytest.fixture
def make_ctx(tmp_path: Path) -> Callable[..., Any]:
    """Build a StageContext for a registered stage with a real ArtifactStore under tmp_path."""
    from llmpipe.executor import LocalExecutor
    from llmpipe.stage import STAGES, StageContext
    from llmpipe.store import ArtifactStore

    store = ArtifactStore(tmp_path / "store")

    def make(name: str, config: Any, inputs: dict[str, Path], out: Path, workers: int = 1) -> StageContext:
        out.mkdir(parents=True, exist_ok=True)
        return StageContext(spec=STAGES[name], config=config, pipeline=None, key="test", out=out,
                            inputs=inputs, input_keys={k: "k" + k for k in inputs}, store=store,
                            executor=LocalExecutor(workers))

    return make
