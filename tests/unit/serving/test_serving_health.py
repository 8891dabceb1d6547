"""Readiness follows generation: a real Triton server whose model raises in every forward pass is not
healthy behind the OpenAI API, and is again once generation works.

The fault is planted in the served repository itself: the generated ``model.py`` gets a subclass of its
own model whose forward pass raises while a flag file exists (the server runs that file unchanged
otherwise), so the failures are the real ones a broken model sends: ``generation failed`` errors from
the batch model and from the streaming model's running batch.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from llmpipe.serving import server as srv
from llmpipe.serving.config import DeployConfig
from llmpipe.serving.openai_api import api_config, serve_api
from llmpipe.serving.repository import write_model_repository

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not srv.available(), reason="no Triton binary: run scripts/install.sh")]
MODEL = "tiny_lm"
CACHE_S = 0.5  # /health trusts an outcome this recent

PLANT = '''

_Served = TritonPythonModel


class TritonPythonModel(_Served):  # planted by tests/unit/serving/test_serving_health.py
    def initialize(self, args):
        super().initialize(args)
        forward = self.gen.model.forward

        def failing(*a, **kw):
            if os.path.exists({flag!r}):
                raise RuntimeError("planted failure")
            return forward(*a, **kw)

        self.gen.model.forward = failing
'''


@pytest.fixture()
def flag(tmp_path: Path) -> Path:
    return tmp_path / "FAIL"


@pytest.fixture()
def api(tiny_checkpoint: Path, tmp_path: Path, flag: Path) -> Iterator[str]:
    """The OpenAI API in front of a server whose models (batch and streaming) fail while ``flag`` exists;
    the response cache on, so a probe the cache could answer would hide the failure."""
    cfg = DeployConfig(model_name=MODEL, response_cache=True, max_batch_size=2, preferred_batch_sizes=[2])
    repo = tmp_path / "repo"
    write_model_repository(tiny_checkpoint, repo, cfg, 1)
    for model_py in repo.glob("*/1/model.py"):
        model_py.write_text(model_py.read_text() + PLANT.format(flag=str(flag)))
    with srv.serve(repo) as s, serve_api(api_config(s.repo, s.grpc_url, health_cache_s=CACHE_S)) as a:
        yield a.url


def _health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url.replace("/v1", "/health"), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_health_goes_red_while_generation_fails_and_green_after(api: str, flag: Path) -> None:
    client = openai.OpenAI(base_url=api, api_key="none", max_retries=0, timeout=120)
    assert _health(api) == (200, {"ready": True})
    client.completions.create(model=MODEL, prompt="hello", max_tokens=2, temperature=0)  # cached from now on

    flag.touch()  # every forward pass raises from now on; Triton still reports the models ready
    with pytest.raises(openai.InternalServerError, match="generation failed"):
        client.completions.create(model=MODEL, prompt="the fox", max_tokens=4, temperature=0)
    status, body = _health(api)  # the client's failure, recent: red at once
    assert status == 503 and "planted failure" in body["reason"]
    time.sleep(CACHE_S * 2)
    status, body = _health(api)  # its own probe: the batch model fails (a cached answer does not hide it)
    assert status == 503 and "planted failure" in body["reason"]
    with pytest.raises(openai.APIError, match="generation failed"):  # the streaming model fails too
        list(client.completions.create(model=MODEL, prompt="the fox", max_tokens=4, temperature=0, stream=True))

    flag.unlink()  # generation works again
    time.sleep(CACHE_S * 2)
    assert _health(api) == (200, {"ready": True})  # the probe generated on both models
    # the request that failed, again: Triton's response cache replays its error as an empty answer, and the
    # front end asks again under a fresh seed (greedy: the same answer) instead of refusing it for good
    r = client.completions.create(model=MODEL, prompt="the fox", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1
