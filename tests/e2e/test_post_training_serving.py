"""configs/tiny-chat.yaml's whole lifecycle: evaluate, quantize and deploy take the tuned (DPO) model,
and our OpenAI front end serves it through its chat template.

The library DAG on the store in the repository root, as tests/e2e/test_post_training.py uses it: the
stages up to pretrain are tiny.yaml's (``make run`` filled them), sft and preference are that test's;
this module adds evaluate, quantize and deploy of the tuned model (minutes on 2 cores when not cached).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import run_tiny_chat

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lifecycle() -> dict[str, Any]:
    from llmpipe.dag import open_store, plan

    cfg, done = run_tiny_chat()  # the lifecycle: every active stage
    runs = {r.stage: r for r in done}
    store, planned = open_store(cfg), plan(cfg)
    return {"runs": runs, "manifests": {n: store.get(n, planned[n].key).manifest for n in runs}}


def test_evaluate_quantize_and_deploy_take_the_tuned_model(lifecycle: dict[str, Any]) -> None:
    runs, manifests = lifecycle["runs"], lifecycle["manifests"]
    assert list(runs).index("preference") < list(runs).index("evaluate")
    for name in ("evaluate", "quantize"):
        assert manifests[name]["inputs"]["preference"] == runs["preference"].key, name
        assert "pretrain" not in manifests[name]["inputs"], name
    assert manifests["deploy"]["inputs"] == {"quantize": runs["quantize"].key}
    ev, pref = runs["evaluate"].stats, runs["preference"].stats
    assert ev["model_from"] == "preference" and ev["held_out_pairs"] == pref["held_out_pairs"]
    # the preference stage's own measure on the same model and pairs: one function, one figure
    assert ev["preference_accuracy"] == pytest.approx(pref["preference_accuracy"], abs=1e-9)
    assert ev["preference_accuracy"] > 0.5 and ev["reward_margin"] > 0, ev
    assert [s["prompt"] for s in ev["chat_samples"]] == [s["prompt"] for s in pref["samples"]]
    assert all(s["answer"].strip() for s in ev["chat_samples"]), ev["chat_samples"]
    assert runs["quantize"].stats["gate_passed"] is True


def test_the_chat_endpoint_serves_the_tuned_model_with_its_template(lifecycle: dict[str, Any],
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    from openai import OpenAI
    from transformers import AutoTokenizer

    from llmpipe.serving import server
    from llmpipe.serving.layout import DEPLOY
    from llmpipe.serving.openai_api import api_config, serve_api

    if not server.available():
        pytest.skip("no local Triton server (scripts/install.sh installs nvidia-pytriton)")
    runs = lifecycle["runs"]
    question = runs["evaluate"].stats["chat_samples"][0]["prompt"]
    messages = [{"role": "user", "content": question}]
    caplog.set_level(logging.DEBUG, logger="llmpipe.serving.openai_api")
    with server.serve(Path(runs["deploy"].path) / DEPLOY.repository) as srv:
        cfg = api_config(srv.repo, srv.grpc_url)
        with serve_api(cfg) as api:
            client = OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120)
            reply = client.chat.completions.create(model=cfg.model, messages=messages,  # type: ignore[arg-type]
                                                   max_tokens=16, temperature=0)
        tok = AutoTokenizer.from_pretrained(cfg.checkpoint)  # the deployed (tuned, quantized) model's
    assert reply.choices[0].message.content and reply.choices[0].message.content.strip(), reply
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == f"<|user|>\n{question}{tok.eos_token}<|assistant|>\n"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False)["input_ids"])
    assert reply.usage.prompt_tokens > len(tok(question, add_special_tokens=False)["input_ids"]) + 2
    seen = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chat prompt")]
    assert seen and repr(rendered) in seen[-1] and f"({reply.usage.prompt_tokens} tokens," in seen[-1], seen
