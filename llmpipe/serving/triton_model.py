"""Triton Python-backend model for text generation; the deploy stage copies this file to ``<model>/<v>/model.py``.

It is self-contained (torch + transformers only, no llmpipe import) so the same file runs in NVIDIA's
Triton image. Why the tensors look the way they do:

* Text travels as UTF-8 bytes in ``UINT8`` tensors, not ``BYTES``: with numpy 2 the Python backend
  stub of Triton 2.51 (built against numpy 1) corrupts every multi-element tensor it converts to
  numpy (``as_numpy`` repeats the first element) and crashes deserialising ``BYTES`` inputs. Every
  tensor therefore moves through DLPack (``to_dlpack`` / ``Tensor.from_dlpack``), never numpy.
* The dynamic batcher hands ``execute`` several requests at once; they are generated together as one
  left-padded batch (that is where batching pays), grouped by temperature, and each request gets
  its own response or its own error, so one bad request never fails its neighbours.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

try:  # present inside the Triton Python backend only; the generation core is testable without it
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - exercised by the real-server tests
    pb_utils = None

CHECKPOINT_DIR = "checkpoint"
SETTINGS_FILE = "llmpipe_serving.json"


class BadRequest(ValueError):
    """A request the model refuses, with a message meant for the client."""


@dataclass
class GenRequest:
    """One validated request."""

    input_ids: list[int]
    max_tokens: int
    temperature: float


@dataclass
class Limits:
    """Request bounds; written by the deploy stage into ``llmpipe_serving.json``."""

    max_prompt_tokens: int = 512
    max_tokens_limit: int = 256
    default_max_tokens: int = 16

    @classmethod
    def load(cls, path: str) -> Limits:
        if not os.path.exists(path):
            return cls()
        with open(path) as f:
            data = json.load(f)
        return cls(**{k: int(data[k]) for k in ("max_prompt_tokens", "max_tokens_limit",
                                                "default_max_tokens") if k in data})


class Generator:
    """Batched greedy / sampled generation with per-request validation."""

    def __init__(self, checkpoint: str, limits: Limits, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint).to(device).eval()
        self.device = device
        self.limits = limits
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self.pad_id = int(pad)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))

    # -- validation -------------------------------------------------------------------------------
    def parse(self, prompt: bytes | None, input_ids: list[int] | None, max_tokens: int | None,
              temperature: float | None) -> GenRequest:
        """Turn raw inputs into a GenRequest or raise BadRequest saying exactly what is wrong."""
        if (prompt is None) == (input_ids is None):
            raise BadRequest("send exactly one of 'prompt' (UTF-8 bytes as UINT8) or 'input_ids' (INT64)")
        if prompt is not None:
            try:
                text = prompt.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadRequest(f"'prompt' is not valid UTF-8: {e}") from None
            if not text.strip():
                raise BadRequest("'prompt' is empty")
            ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        else:
            ids = list(input_ids or [])
            if not ids:
                raise BadRequest("'input_ids' is empty")
            bad = [t for t in ids if t < 0 or t >= self.vocab_size]
            if bad:
                raise BadRequest(f"'input_ids' has ids outside [0, {self.vocab_size}): {bad[:5]}")
        if len(ids) > self.limits.max_prompt_tokens:
            raise BadRequest(f"prompt has {len(ids)} tokens, over the limit of {self.limits.max_prompt_tokens}")
        n = self.limits.default_max_tokens if max_tokens is None else int(max_tokens)
        if not 1 <= n <= self.limits.max_tokens_limit:
            raise BadRequest(f"'max_tokens' must be in [1, {self.limits.max_tokens_limit}], got {n}")
        t = 0.0 if temperature is None else float(temperature)
        if not (t >= 0.0 and t <= 10.0):  # also rejects NaN
            raise BadRequest(f"'temperature' must be in [0, 10], got {t}")
        return GenRequest(ids, n, t)

    # -- generation -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, reqs: list[GenRequest]) -> list[list[int]]:
        """New token ids per request; requests with the same temperature share one padded batch."""
        out: list[list[int]] = [[] for _ in reqs]
        groups: dict[float, list[int]] = {}
        for i, r in enumerate(reqs):
            groups.setdefault(r.temperature, []).append(i)
        for temp, idx in groups.items():
            for i, ids in zip(idx, self._generate_group([reqs[i] for i in idx], temp), strict=True):
                out[i] = ids
        return out

    def _generate_group(self, reqs: list[GenRequest], temperature: float) -> list[list[int]]:
        width = max(len(r.input_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for row, r in enumerate(reqs):  # left padding: every prompt ends at the same position
            ids[row, width - len(r.input_ids):] = torch.tensor(r.input_ids, dtype=torch.long)
            mask[row, width - len(r.input_ids):] = 1
        sample: dict[str, Any] = ({"do_sample": True, "temperature": temperature, "top_k": 0}
                                  if temperature > 0 else {"do_sample": False})
        gen = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
            max_new_tokens=max(r.max_tokens for r in reqs), pad_token_id=self.pad_id, **sample,
        )
        new = gen[:, width:].tolist()
        return [self._trim(row, r.max_tokens) for row, r in zip(new, reqs, strict=True)]

    def _trim(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Cut at this request's own budget and after its first end-of-sequence token."""
        tokens = tokens[:max_tokens]
        for i, t in enumerate(tokens):
            if t in self.eos_ids:
                return tokens[: i + 1]
        return tokens

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


# -- the Triton side -----------------------------------------------------------------------------
def _tensor(request: Any, name: str) -> torch.Tensor | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else torch.from_dlpack(t.to_dlpack())


def _scalar(t: torch.Tensor | None, name: str) -> float | None:
    if t is None:
        return None
    if t.numel() != 1:
        raise BadRequest(f"'{name}' must hold one value per request, got shape {list(t.shape)}")
    return t.reshape(-1)[0].item()


def _out(name: str, t: torch.Tensor) -> Any:
    return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(t.contiguous()))


def _bad_request(message: str) -> Any:
    """An INVALID_ARG error (HTTP 400 / gRPC INVALID_ARGUMENT) where the backend supports error codes."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)


class TritonPythonModel:
    """Triton's entry points: initialize, execute (one call per dynamic batch), finalize."""

    def initialize(self, args: dict[str, Any]) -> None:
        here = os.path.join(args["model_repository"], args["model_version"])
        kind = args.get("model_instance_kind", "CPU")
        device = f"cuda:{args.get('model_instance_device_id', 0)}" if kind == "GPU" else "cpu"
        torch.set_num_threads(max(1, int(os.environ.get("LLMPIPE_SERVE_THREADS", torch.get_num_threads()))))
        limits = Limits.load(os.path.join(here, SETTINGS_FILE))
        self.gen = Generator(os.path.join(here, CHECKPOINT_DIR), limits, device)

    def _parse(self, request: Any) -> GenRequest:
        prompt = _tensor(request, "prompt")
        ids = _tensor(request, "input_ids")
        return self.gen.parse(
            None if prompt is None else bytes(prompt.reshape(-1).to(torch.uint8).tolist()),
            None if ids is None else [int(x) for x in ids.reshape(-1).tolist()],
            None if (v := _scalar(_tensor(request, "max_tokens"), "max_tokens")) is None else int(v),
            _scalar(_tensor(request, "temperature"), "temperature"),
        )

    def execute(self, requests: list[Any]) -> list[Any]:
        parsed: list[GenRequest | str] = []
        for r in requests:
            try:
                parsed.append(self._parse(r))
            except BadRequest as e:
                parsed.append(str(e))
        good = [p for p in parsed if isinstance(p, GenRequest)]
        try:
            results = iter(self.gen.generate(good)) if good else iter(())
        except Exception as e:  # noqa: BLE001 - report to every client of the batch, keep serving
            return [pb_utils.InferenceResponse(error=pb_utils.TritonError(f"generation failed: {e}"))
                    for _ in requests]
        responses = []
        for p in parsed:
            if isinstance(p, str):
                responses.append(pb_utils.InferenceResponse(error=_bad_request(p)))
                continue
            tokens = next(results)
            text = self.gen.decode(tokens).encode("utf-8")
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                _out("text", torch.tensor(list(text), dtype=torch.uint8).reshape(1, -1)),
                _out("output_ids", torch.tensor(tokens, dtype=torch.long).reshape(1, -1)),
            ]))
        return responses

    def finalize(self) -> None:
        self.gen = None
