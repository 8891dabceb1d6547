"""Greedy generation with vLLM's offline ``LLM``, run by vLLM's own Python (test_vllm.py starts it).

vLLM lives in an environment of its own (see test_vllm.py), so this script imports nothing of
llmpipe: it reads ``{"model", "dtype", "prompts": [[token ids]], "max_tokens", "max_model_len"}`` as JSON on
stdin and prints one line ``VLLM_RESULT {"tokens": [[ids]], "finish": [reason]}``. Token ids in and
out, so no tokenizer difference can hide behind text. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the caller), so it ends when the script does.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(sys.stdin.read())
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=int(spec["max_model_len"]), seed=0,
              enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=int(spec["max_tokens"]))
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
    res = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
           "finish": [o.outputs[0].finish_reason for o in outs]}
    print("VLLM_RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
