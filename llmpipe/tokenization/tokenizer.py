"""The ``tokenizer`` stage: train a byte-level BPE on the curated corpus, or load one by path.

The artifact is a ``transformers`` tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``)
so ``AutoTokenizer.from_pretrained(artifact_dir)`` loads it with bos/eos/pad set and a chat template
(``chat_template.jinja``), plus ``llmpipe_tokenizer.json`` ({"vocab_size", "bos_id", "eos_id",
"pad_id", "source"}) that the tokenize stage reads to encode with the bare ``tokenizers`` library.

The chat template (:data:`CHAT_TEMPLATE`) is deliberately plain, so any engine that applies a
Hugging Face template (transformers, vLLM's and our OpenAI chat endpoints, post-training) renders
the same text: each message is its role marker, a newline, the content and end-of-text::

    <|system|>\nBe brief.<|endoftext|><|user|>\nHi<|endoftext|><|assistant|>\n

``add_generation_prompt`` appends the assistant's marker and newline; the model answers and stops at
end-of-text, the eos id of the exported model. The role markers are special tokens of the trained
tokenizer (``tokenizer.special_tokens``), one id each; a document that contains their text is still
encoded as plain text by the tokenize stage. A pretrained tokenizer keeps its own template, or gets
this one (its markers then encode as ordinary text: its vocabulary is never grown).

Training reads the original documents only (no augmented children: their noise should not shape the
vocabulary), in shard order. A byte-level BPE with no normalizer round-trips any text exactly:
``decode(encode(text)) == text``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmpipe.document import iter_documents, shard_paths
from llmpipe.stage import StageContext, stage
from llmpipe.tokenization.config import TokenizerConfig
from llmpipe.tokenization.layout import TOKENIZER

# version 2: the role markers are special tokens and the chat template is saved with the tokenizer
VERSION = "2"
META = TOKENIZER.meta
# the role markers it writes are config.ROLE_TOKENS: special tokens of the trained tokenizer
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('chat template: role must be system, user or assistant, not ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + eos_token -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


def corpus_texts(artifact_dir: Path, limit: int | None = None) -> Iterator[str]:
    """Texts of the original (non-augmented) documents of a curated artifact, in shard order."""
    n = 0
    for p in shard_paths(artifact_dir):
        for d in iter_documents(p):
            if d.metadata.get("parent_id"):
                continue
            if limit is not None and n >= limit:
                return
            n += 1
            yield d.text


def train_bpe(texts: Iterator[str], cfg: TokenizerConfig) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (no normalizer: exact round trip)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency, special_tokens=list(cfg.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap(tok: Any, cfg: TokenizerConfig) -> Any:
    """The ``transformers`` fast tokenizer around a trained ``tokenizers.Tokenizer``."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=cfg.bos_token, eos_token=cfg.eos_token,
                                   pad_token=cfg.pad_token, model_max_length=cfg.model_max_length,
                                   chat_template=CHAT_TEMPLATE)


def load_pretrained(path: str, cfg: TokenizerConfig) -> Any:
    """A pretrained fast tokenizer by path, with an eos and a pad token distinct from eos."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer.pretrained: no tokenizer directory at {path!r}")
    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"tokenizer.pretrained: {path!r} has no fast (tokenizer.json) tokenizer")
    if tok.eos_token is None:
        raise ValueError(f"tokenizer.pretrained: {path!r} defines no eos token; packing needs one")
    if tok.pad_token is None or tok.pad_token == tok.eos_token:
        tok.add_special_tokens({"pad_token": cfg.pad_token})
    if not tok.chat_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def save(hf_tok: Any, out: Path, source: str) -> dict[str, Any]:
    """Save the tokenizer and the ids llmpipe needs; returns that metadata."""
    save_loaded(hf_tok, out)  # a pretrained one (``tokenizer.pretrained``) was loaded with from_pretrained
    meta = {"vocab_size": len(hf_tok), "bos_id": hf_tok.bos_token_id, "eos_id": hf_tok.eos_token_id,
            "pad_id": hf_tok.pad_token_id, "source": source}
    (out / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
    return meta


def save_for_model(tokenizer_dir: str | Path, out: Path, max_positions: int) -> None:
    """Save the tokenizer artifact's tokenizer beside a model (pretrain's export, the quantized model):
    ``model_max_length`` becomes the model's positions, so that ``truncation=True`` and every server
    that reads it (vLLM, our OpenAI endpoint) refuse what the model cannot read; the rest, chat
    template included, is the tokenizer artifact's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.model_max_length = int(max_positions)
    save_loaded(tok, out)


def save_loaded(tok: Any, out: str | Path) -> None:
    """``tok.save_pretrained(out)`` for a tokenizer loaded with ``from_pretrained``, without the loading
    environment: transformers writes ``local_files_only`` (true under ``HF_HUB_OFFLINE``, else false)
    into ``tokenizer_config.json``. That is no property of the tokenizer, and two runs of one key must
    give one set of bytes whatever the environment."""
    tok.save_pretrained(str(out))
    path = Path(out) / TOKENIZER.config
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if cfg.pop("local_files_only", None) is not None:  # written back as transformers writes it
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def load_for_encoding(artifact_dir: str | Path) -> tuple[Any, dict[str, Any]]:
    """(bare ``tokenizers.Tokenizer``, metadata) of a tokenizer artifact, ready for exact encoding.

    Special-token strings inside documents are encoded as plain text, so a document that contains
    ``<|endoftext|>`` can never fake a document boundary.
    """
    from tokenizers import Tokenizer

    d = Path(artifact_dir)
    tok = Tokenizer.from_file(str(d / TOKENIZER.tokenizer))
    tok.encode_special_tokens = True
    tok.no_truncation()
    tok.no_padding()
    return tok, json.loads((d / META).read_text())


def bytes_per_token(tok: Any, artifact_dir: Path, per_lang: int = 200) -> list[dict[str, Any]]:
    """Compression per language on up to ``per_lang`` documents each: a quick check of the vocabulary."""
    samples: dict[str, list[str]] = {}
    for p in shard_paths(artifact_dir):
        for d in iter_documents(p):
            lst = samples.setdefault(str(d.metadata.get("lang") or "und"), [])
            if len(lst) < per_lang:
                lst.append(d.text)
    rows = []
    for lang, texts in sorted(samples.items()):
        n_tok = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        rows.append({"lang": lang, "docs": len(texts), "bytes": n_bytes, "tokens": n_tok,
                     "bytes_per_token": round(n_bytes / max(1, n_tok), 3)})
    return rows


@stage("tokenizer", version=VERSION, inputs=("augment",), config_field="tokenizer", flow="data_refresh",
       requires=("tokenizers", "transformers"), extra="tokenize")
def run_tokenizer(ctx: StageContext) -> dict[str, Any]:
    """Train a byte-level BPE on the curated corpus (or load a pretrained one) for transformers."""
    cfg: TokenizerConfig = ctx.config
    src = ctx.inputs["augment"]
    t0 = time.perf_counter()
    if cfg.pretrained:
        path = cfg.pretrained
        if not Path(path).is_absolute() and hasattr(ctx.pipeline, "base_dir"):
            path = str(ctx.pipeline.base_dir() / path)
        hf_tok, source, docs = load_pretrained(path, cfg), f"pretrained:{cfg.pretrained}", 0
    else:
        counter = {"n": 0}

        def texts() -> Iterator[str]:
            for t in corpus_texts(src, cfg.max_train_docs):
                counter["n"] += 1
                yield t

        tok = train_bpe(texts(), cfg)
        if counter["n"] == 0:
            raise ValueError(f"tokenizer: the input artifact {src} has no documents to train on")
        hf_tok, source, docs = wrap(tok, cfg), "trained", counter["n"]
    meta = save(hf_tok, ctx.out, source)
    enc, _ = load_for_encoding(ctx.out)
    rows = bytes_per_token(enc, src)
    ctx.report_table("tokenizer-compression", "Bytes per token by language", rows)
    return {**meta, "train_docs": docs, "seconds": round(time.perf_counter() - t0, 3), "compression": rows}
