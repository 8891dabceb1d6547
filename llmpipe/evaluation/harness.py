"""lm-evaluation-harness inside ``evaluate``: the field's tasks and scorers on the stage's model, offline.

Users compare models on lm-evaluation-harness numbers, so the task metrics of ``evaluate`` (and of
the quantize gate, which re-runs them on the quantized model) come from the harness itself:
``lm_eval.simple_evaluate`` over its Hugging Face backend (``HFLM``) wrapped around the model the
stage already loaded, with tasks found by the harness's ``TaskManager``.

Tasks are named in ``evaluate.harness.tasks``: the built-in ones shipped in
``llmpipe/data/evaluation/tasks`` (``tiny_mc``, ``tiny_cloze``, ``tiny_docs``: en, de, fr, zh), a
folder of the user's task YAMLs (every task in it), or one YAML file. Nothing is downloaded: the
built-in tasks read their JSONL through :func:`local_json`, and a user's task reads local files
(``dataset_path: json`` with absolute ``data_files``, a ``datasets`` folder, or ``local_json``).

The harness's numbers move with the batch size, the backend, the dtype and the few-shot sample, so
the whole harness config is part of the stage key and is written beside the numbers.

``evaluate.tasks`` (multiple-choice JSONL files) runs through the harness too, as inline tasks
scored like ``tiny_mc``: llmpipe had its own scorer for them, which agreed with the harness's
``acc`` (and its byte-normalised ``acc_norm`` with ``acc_bytes``) on ``tiny_mc``; it was removed
so that one scorer, the field's, gives every task number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmpipe.evaluation.config import HarnessConfig, TaskConfig

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

BUILTIN_TASKS = Path(__file__).resolve().parent.parent / "data" / "evaluation" / "tasks"
BUILTIN_NAMES = ("tiny_mc", "tiny_cloze", "tiny_docs")
YAML_SUFFIXES = (".yaml", ".yml")


def local_json(data_files: dict[str, str] | str, config_source: str | None = None, limit: int | None = None,
               **_: Any) -> Any:
    """The harness's ``custom_dataset`` for task data in JSON lines beside the task's YAML.

    The harness calls it with the task's ``dataset_kwargs`` and ``metadata``; its ``config_source``
    (the YAML's path) anchors relative ``data_files``, so a task folder works wherever it is
    installed. Lines are read with the file and line named in any error; no cache, no network.
    ``limit`` keeps the first lines only (``evaluate.tasks[].limit``).
    """
    import datasets

    from llmpipe.files import jsonl_values

    base = Path(config_source).parent if config_source and config_source != "inline" else Path.cwd()
    files = {"test": data_files} if isinstance(data_files, str) else dict(data_files)
    splits = {}
    for split, name in files.items():
        path = Path(name) if Path(name).is_absolute() else base / name
        if not path.is_file():
            raise FileNotFoundError(f"{config_source or 'task'}: dataset_kwargs.data_files.{split}: no file {path}")
        rows = [v for _, v in jsonl_values(path)][:limit]
        if not rows:
            raise ValueError(f"{path}: no examples for split {split!r}")
        splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)


def multiple_choice_spec(task: TaskConfig) -> dict[str, Any]:
    """An ``evaluate.tasks`` JSONL file (``{context, choices, label}`` per line) as an inline harness task,
    scored like ``tiny_mc``: the choices follow the context as written (no delimiter added)."""
    from llmpipe.evaluation.metrics import load_task

    load_task(task.resolved(), task.limit)  # each line checked, bad ones named by file and line
    return {**MULTIPLE_CHOICE, "task": task.name, "custom_dataset": local_json,
            "dataset_kwargs": {"data_files": {"test": str(task.resolved().resolve())}, "limit": task.limit}}


MULTIPLE_CHOICE: dict[str, Any] = {
    "output_type": "multiple_choice", "test_split": "test", "doc_to_text": "{{context}}",
    "doc_to_choice": "{{choices}}", "doc_to_target": "label", "target_delimiter": "",
    "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                    for m in ("acc", "acc_norm", "acc_bytes")],
    "metadata": {"version": 1.0},
}


def task_manager(cfg: HarnessConfig) -> tuple[TaskManager, list[str]]:
    """The harness's TaskManager over the built-in tasks and the user's folders, and the task specs.

    The harness's own task catalogue is left out (``include_defaults=False``): its tasks download
    their data, and indexing it costs seconds per run. A name that no folder defines is an error
    that lists the names there are.
    """
    from lm_eval.tasks import TaskManager

    folders, files, names = [BUILTIN_TASKS], [], []
    for entry in cfg.tasks:
        p = Path(entry).expanduser()
        if p.suffix in YAML_SUFFIXES:
            if not p.is_file():
                raise FileNotFoundError(f"evaluate.harness.tasks: no task YAML at {p}")
            files.append(str(p.resolve()))
        elif p.is_dir():
            folders.append(p.resolve())
        elif "/" in entry or entry.startswith("."):
            raise FileNotFoundError(f"evaluate.harness.tasks: no task folder at {p}")
        else:
            names.append(entry)
    tm = TaskManager(include_path=[str(f) for f in folders], include_defaults=False)
    unknown = [n for n in names if n not in tm.all_tasks]
    if unknown:
        raise ValueError(f"evaluate.harness.tasks: no task named {unknown} (known: {tm.all_tasks}; a path "
                         "to a folder of task YAMLs or to one YAML file adds its tasks)")
    for folder in folders[1:]:  # a user's folder: every task defined in it
        names += [n for n in tm.all_subtasks if _under(tm.task_index[n].yaml_path, folder)]
    return tm, list(dict.fromkeys(names)) + files


def _under(path: Any, folder: Path) -> bool:
    return path is not None and Path(path).resolve().is_relative_to(folder)


def harness_lm(model: Any, tokenizer: Any, cfg: HarnessConfig) -> Any:
    """The harness's Hugging Face backend around an already loaded model (no second copy)."""
    import torch
    from lm_eval.models.huggingface import HFLM

    if cfg.dtype != "auto":  # in place: the harness runs last on this model
        model = model.to(getattr(torch, cfg.dtype))
    if cfg.chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("evaluate.harness.chat_template: true, but the model's tokenizer has no chat template")
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size, max_length=cfg.max_length)


def run_harness(model: Any, tokenizer: Any, cfg: HarnessConfig, files: Sequence[TaskConfig] = ()
                ) -> dict[str, Any]:
    """Every configured harness task (and each multiple-choice JSONL of ``files``) on ``model``: per
    task, its metrics and their standard errors, beside the config they were computed with (see
    :func:`harness_results`)."""
    from lm_eval import simple_evaluate

    tm, specs = task_manager(cfg)
    inline = [multiple_choice_spec(t) for t in files]
    out = simple_evaluate(harness_lm(model, tokenizer, cfg), tasks=[*specs, *inline], task_manager=tm,
                          num_fewshot=cfg.num_fewshot, fewshot_random_seed=cfg.fewshot_seed,
                          limit=cfg.limit, bootstrap_iters=cfg.bootstrap_iters,
                          apply_chat_template=cfg.chat_template, log_samples=False)
    res = harness_results(out, cfg)
    for t in files:  # the quantize gate's max_accuracy_drop applies to these, as before the harness
        res["tasks"][t.name]["source"] = "evaluate.tasks"
    return res


def _number(v: Any) -> float | None:
    """A metric value as a float; the harness writes "N/A" where it has no standard error."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


def harness_results(out: dict[str, Any], cfg: HarnessConfig) -> dict[str, Any]:
    """``simple_evaluate``'s output as results: ``tasks[name]`` holds ``metrics``, ``stderr`` (None where
    the harness gives none), ``higher_is_better``, ``samples`` and ``num_fewshot``. The run's date,
    git hash and environment stay out: the same key gives the same bytes."""
    import lm_eval

    tasks = {}
    for name, row in sorted(out["results"].items()):
        metrics, stderr = {}, {}
        for key, value in row.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            label = metric if filt == "none" else f"{metric},{filt}"
            metrics[label] = _number(value)
            stderr[label] = _number(row.get(f"{metric}_stderr,{filt}"))
        n = out.get("n-samples", {}).get(name, {})
        tasks[name] = {"metrics": metrics, "stderr": stderr,
                       "higher_is_better": out.get("higher_is_better", {}).get(name, {}),
                       "samples": n.get("effective"), "num_fewshot": out.get("n-shot", {}).get(name)}
    return {"config": cfg.key_dict(), "lm_eval_version": lm_eval.__version__, "tasks": tasks}
