"""A small text-generation client over tritonclient HTTP or gRPC, speaking the deployed model's tensors.

Text goes as UTF-8 bytes in UINT8 tensors (see llmpipe/serving/triton_model.py for why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Protocol = Literal["http", "grpc"]


@dataclass
class Generation:
    text: str
    output_ids: list[int]


def _module(protocol: Protocol) -> Any:
    if protocol == "http":
        import tritonclient.http as mod
    elif protocol == "grpc":
        import tritonclient.grpc as mod
    else:
        raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
    return mod


class TextClient:
    """One connection to one model; not thread-safe (the load test gives each worker its own)."""

    def __init__(self, url: str, model: str, protocol: Protocol = "http", timeout_s: float = 60.0) -> None:
        self.mod = _module(protocol)
        self.protocol = protocol
        self.model = model
        kw: dict[str, Any] = {"network_timeout": timeout_s, "connection_timeout": timeout_s} \
            if protocol == "http" else {}
        self.client = self.mod.InferenceServerClient(url, **kw)
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> TextClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tensor(self, name: str, array: np.ndarray, dtype: str) -> Any:
        """A raw input tensor (the tests use it to send wrong dtypes and shapes on purpose)."""
        t = self.mod.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    def infer(self, inputs: list[Any]) -> Any:
        outputs = [self.mod.InferRequestedOutput(n) for n in ("text", "output_ids")]
        return self.client.infer(self.model, inputs, outputs=outputs)

    def generate(self, prompt: str | None = None, input_ids: list[int] | None = None, max_tokens: int = 16,
                 temperature: float = 0.0) -> Generation:
        """Generate from a prompt or token ids; raises tritonclient's InferenceServerException on errors."""
        inputs = []
        if prompt is not None:
            raw = np.frombuffer(prompt.encode("utf-8"), dtype=np.uint8).reshape(1, -1)
            inputs.append(self.tensor("prompt", raw, "UINT8"))
        if input_ids is not None:
            inputs.append(self.tensor("input_ids", np.asarray([input_ids], dtype=np.int64), "INT64"))
        inputs.append(self.tensor("max_tokens", np.asarray([[max_tokens]], dtype=np.int32), "INT32"))
        inputs.append(self.tensor("temperature", np.asarray([[temperature]], dtype=np.float32), "FP32"))
        res = self.infer(inputs)
        return Generation(res.as_numpy("text").tobytes().decode("utf-8"),
                          [int(x) for x in res.as_numpy("output_ids").reshape(-1)])

    def statistics(self) -> dict[str, Any]:
        """The server's model statistics (inference and batch-size counts) as a dict."""
        if self.protocol == "grpc":
            return self.client.get_inference_statistics(self.model, as_json=True)
        return self.client.get_inference_statistics(self.model)
