"""Greedy generation with vLLM's offline ``LLM``, run by vLLM's own Python (test_vllm.py starts it).

vLLM lives in an environment of its own (see test_vllm.py), so this script imports nothing of
llmpipe: it reads a JSON list of runs ``[{"model", "dtype", "prompts": [[token ids]], "max_tokens",
"max_model_len"}]`` on stdin and prints, for run ``i``, one line ``VLLM_RESULT i {"tokens": [[ids]],
"finish": [reason]}`` or ``VLLM_ERROR i "<traceback>"``. Token ids in and out, so no tokenizer
difference can hide behind text. Every run is in this one process, one engine after the other (vLLM's
import and platform set-up are most of a run's time on 2 cores: paid once, not once per model); an
engine that fails to start is reported and the next run still goes. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the caller), so it ends when the script does.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any


def greedy(spec: dict[str, Any]) -> dict[str, list]:
    """One engine on ``spec["model"]``, greedy on every prompt; the engine is torn down before returning."""
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    llm = None
    try:
        llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=int(spec["max_model_len"]), seed=0,
                  enforce_eager=True)
        params = SamplingParams(temperature=0.0, max_tokens=int(spec["max_tokens"]))
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                "finish": [o.outputs[0].finish_reason for o in outs]}
    finally:
        del llm
        cleanup_dist_env_and_memory()  # vLLM's own way to start another engine in the same process


def main() -> int:
    for i, spec in enumerate(json.loads(sys.stdin.read())):
        try:
            print(f"VLLM_RESULT {i} " + json.dumps(greedy(spec)), flush=True)
        except Exception:  # noqa: BLE001 - reported to the test, which decides (skip or fail)
            err = traceback.format_exc()
            print(err, file=sys.stderr, flush=True)
            print(f"VLLM_ERROR {i} " + json.dumps(err), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
