"""The tokenizer stage: a byte-level BPE that transformers loads and that round-trips any text."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from llmpipe.tokenization.config import TokenizerConfig
from llmpipe.tokenization.tokenizer import load_for_encoding, run_tokenizer

TRICKY = "Tabs\tand  spaces \n\n中文，標點！ émigrés 🎉🎉 <|endoftext|> <|pad|> \u200b end"


def test_trained_tokenizer_loads_with_autotokenizer_and_round_trips(pipeline_dirs, synth) -> None:
    from transformers import AutoTokenizer

    dirs = pipeline_dirs([synth(60, 30)])
    tok = AutoTokenizer.from_pretrained(dirs["tokenizer"])
    assert tok.eos_token == "<|endoftext|>" and tok.bos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    assert tok.pad_token_id != tok.eos_token_id and 300 < len(tok) <= 600
    assert (dirs["tokenizer"] / "tokenizer_config.json").is_file()
    assert tok.decode(tok(TRICKY, add_special_tokens=False)["input_ids"]) == TRICKY
    bare, meta = load_for_encoding(dirs["tokenizer"])
    ids = bare.encode(TRICKY, add_special_tokens=False).ids
    assert meta["eos_id"] not in ids and meta["pad_id"] not in ids  # special strings in text stay text
    assert bare.decode(ids, skip_special_tokens=False) == TRICKY


def test_chat_template_is_saved_and_marks_roles_with_special_tokens(pipeline_dirs, synth) -> None:
    """The saved template renders role marker, newline, content, end-of-text; each marker is one special id,
    the same text inside a document stays text; an unknown role is an error naming it."""
    from jinja2.exceptions import TemplateError
    from transformers import AutoTokenizer

    d = pipeline_dirs([synth(60, 30)])["tokenizer"]
    assert (d / "chat_template.jinja").is_file()
    tok = AutoTokenizer.from_pretrained(d)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>\nBe brief.<|endoftext|><|user|>\nHi<|endoftext|><|assistant|>\n"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    roles = [tok.convert_tokens_to_ids(r) for r in ("<|system|>", "<|user|>", "<|assistant|>")]
    assert [i for i in ids if i in roles] == roles and ids.count(tok.eos_token_id) == 2
    assert tok.decode(ids, skip_special_tokens=True) == "\nBe brief.\nHi\n"
    bare, _ = load_for_encoding(d)
    assert not set(bare.encode("<|user|> hi", add_special_tokens=False).ids) & set(roles)
    with pytest.raises(TemplateError, match="not tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_training_is_deterministic(pipeline_dirs, synth) -> None:
    a = pipeline_dirs([synth(40, 20)], name="a")["tokenizer"] / "tokenizer.json"
    b = pipeline_dirs([synth(40, 20)], name="b")["tokenizer"] / "tokenizer.json"
    assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()


def test_pretrained_tokenizer_by_path(pipeline_dirs, synth, make_ctx, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    dirs = pipeline_dirs([synth(20, 10)])
    out = tmp_path / "pre"
    stats = run_tokenizer(make_ctx("tokenizer", TokenizerConfig(pretrained=str(dirs["tokenizer"])),
                                   {"augment": dirs["augment"]}, out))
    assert stats["source"].startswith("pretrained:") and stats["train_docs"] == 0
    assert len(AutoTokenizer.from_pretrained(out)) == len(AutoTokenizer.from_pretrained(dirs["tokenizer"]))
    with pytest.raises(FileNotFoundError, match="tokenizer.pretrained"):
        run_tokenizer(make_ctx("tokenizer", TokenizerConfig(pretrained=str(tmp_path / "nope")),
                               {"augment": dirs["augment"]}, tmp_path / "x"))


def test_config_errors() -> None:
    with pytest.raises(ValidationError, match="at least 260"):
        TokenizerConfig(vocab_size=100)
    with pytest.raises(ValidationError, match="must be one of special_tokens"):
        TokenizerConfig(eos_token="</s>")
    with pytest.raises(ValidationError, match="pad_token must differ"):
        TokenizerConfig(pad_token="<|endoftext|>")
    with pytest.raises(ValidationError, match=r"lacks the chat template's role markers \['<\|user\|>'"):
        TokenizerConfig(special_tokens=["<|endoftext|>", "<|pad|>", "<|system|>", "<|assistant|>"])


def test_the_tokenizer_saved_beside_a_model_is_the_same_bytes_online_and_offline(pipeline_dirs, synth,
                                                                                  tmp_path) -> None:
    """``HF_HUB_OFFLINE`` (which transformers records as ``local_files_only``) leaves no trace in the files
    pretrain and quantize publish: each environment saves in a fresh interpreter, and both match."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    dirs = pipeline_dirs([synth(60, 30)])
    code = ("import sys; from pathlib import Path; from llmpipe.tokenization.tokenizer import save_for_model; "
            "save_for_model(sys.argv[1], Path(sys.argv[2]), 64)")
    saved = {}
    for env_value in ("1", "0"):
        out = tmp_path / f"offline-{env_value}"
        env = {**os.environ, "HF_HUB_OFFLINE": env_value, "PYTHONPATH": str(ROOT)}
        r = subprocess.run([sys.executable, "-c", code, str(dirs["tokenizer"]), str(out)], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        saved[env_value] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    assert saved["0"] == saved["1"]
    assert b"local_files_only" not in saved["1"]["tokenizer_config.json"]
