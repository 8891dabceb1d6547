"""Small flows for the ops harness tests: they run in a worker subprocess like the real ones."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task


@task
def write(path: str, text: str) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    return path


@flow(name="hello")
def hello(out: str = "/dev/null", text: str = "hello") -> str:
    """Write ``text`` to ``out``: proves the worker ran the flow with our parameters."""
    return write(out, text)


@flow(name="always-fails")
def always_fails(reason: str = "boom") -> None:
    """Fail on purpose: exercises the failed-run alert."""
    raise RuntimeError(reason)
