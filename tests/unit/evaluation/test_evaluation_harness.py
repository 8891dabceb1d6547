"""lm-evaluation-harness inside evaluate: the built-in offline tasks, the stage's results and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmpipe.evaluation.config import EvaluateConfig, HarnessConfig
from llmpipe.evaluation.harness import BUILTIN_NAMES, BUILTIN_TASKS, run_harness, task_manager

CPU = torch.device("cpu")
BUILTIN = HarnessConfig(tasks=list(BUILTIN_NAMES))


@pytest.fixture(scope="module")
def lm(toy_lm):  # noqa: ANN001, ANN201
    from llmpipe.evaluation.model_io import load_model, load_tokenizer

    return load_model(toy_lm.pretrain, CPU), load_tokenizer(toy_lm.pretrain)


def test_builtin_tasks_load_offline_through_the_harness_task_manager() -> None:
    tm, specs = task_manager(BUILTIN)
    assert specs == list(BUILTIN_NAMES) and set(BUILTIN_NAMES) <= set(tm.all_subtasks)
    tasks = tm.load(specs)["tasks"]
    kinds = {n: t.get_config("output_type") for n, t in tasks.items()}
    assert kinds == {"tiny_mc": "multiple_choice", "tiny_cloze": "loglikelihood",
                     "tiny_docs": "loglikelihood_rolling"}
    for name, t in tasks.items():
        docs = list(t.eval_docs)
        assert 10 <= len(docs) <= 60, name  # tens of items: seconds on the tiny model
        assert {d["lang"] for d in docs} >= {"en", "de", "fr", "zh"}, name
    mc = list(tasks["tiny_mc"].eval_docs)
    assert len({d["label"] for d in mc}) == 3  # the right answer sits in every position


def test_task_errors_name_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no task named \['nope'\] \(known: .*tiny_mc"):
        task_manager(HarnessConfig(tasks=["nope"]))
    with pytest.raises(FileNotFoundError, match="no task folder at"):
        task_manager(HarnessConfig(tasks=[str(tmp_path / "missing") + "/"]))
    with pytest.raises(FileNotFoundError, match="no task YAML at"):
        task_manager(HarnessConfig(tasks=[str(tmp_path / "missing.yaml")]))
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="tasks named twice"):
        HarnessConfig(tasks=["tiny_mc", "tiny_mc"])


def user_task(folder: Path, data: str | None) -> Path:
    """A user's task folder: the built-in multiple-choice YAML under another name, data beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    yaml = (BUILTIN_TASKS / "tiny_mc" / "tiny_mc.yaml").read_text().replace("task: tiny_mc", "task: my_mc")
    (folder / "my_mc.yaml").write_text(yaml.replace("tiny_mc.jsonl", "items.jsonl"))
    if data is not None:
        (folder / "items.jsonl").write_text(data)
    return folder


def test_a_user_folder_adds_its_tasks_and_bad_data_names_file_and_line(lm, tmp_path: Path) -> None:  # noqa: ANN001
    rows = [json.loads(line) for line in (BUILTIN_TASKS / "tiny_mc" / "tiny_mc.jsonl").read_text().splitlines()]
    folder = user_task(tmp_path / "mine", "\n".join(json.dumps(r) for r in rows[:6]) + "\n")
    tm, specs = task_manager(HarnessConfig(tasks=[str(folder)]))
    assert specs == ["my_mc"]
    res = run_harness(*lm, HarnessConfig(tasks=[str(folder)]))
    assert res["tasks"]["my_mc"]["samples"] == 6
    bad = user_task(tmp_path / "bad", json.dumps(rows[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"items.jsonl:2: not JSON"):
        run_harness(*lm, HarnessConfig(tasks=[str(bad)]))
    gone = user_task(tmp_path / "gone", None)
    with pytest.raises(FileNotFoundError, match=r"my_mc.yaml: dataset_kwargs.data_files.test: no file .*items.jsonl"):
        run_harness(*lm, HarnessConfig(tasks=[str(gone)]))


def test_harness_results_hold_metrics_stderrs_and_config(lm) -> None:  # noqa: ANN001
    res = run_harness(*lm, BUILTIN)
    assert res["config"] == BUILTIN.key_dict() and res["lm_eval_version"].startswith("0.4.")
    mc, cloze, docs = (res["tasks"][n] for n in BUILTIN_NAMES)
    assert mc["samples"] == 48 and cloze["samples"] == 40 and docs["samples"] == 12
    acc, se = mc["metrics"]["acc"], mc["stderr"]["acc"]
    assert 0.0 <= acc <= 1.0
    # the harness's closed form for a mean: sample standard deviation / sqrt(n)
    assert se == pytest.approx((acc * (1 - acc) * 48 / 47) ** 0.5 / 48 ** 0.5)
    assert docs["metrics"]["bits_per_byte"] > 0 and docs["higher_is_better"]["bits_per_byte"] is False
    assert docs["stderr"]["bits_per_byte"] is None  # the harness gives none for it: None, not "N/A"
    json.dumps(res, allow_nan=False)  # strict JSON


def test_evaluation_settings_are_in_the_stage_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmpipe.config import load_config
    from llmpipe.dag import plan

    monkeypatch.chdir(tmp_path)
    base = {"sources": [{"name": "b", "path": "builtin:tiny"}], "evaluate": {"harness": {"tasks": ["tiny_mc"]}}}
    a = plan(load_config(None, data=base))
    for change in ("evaluate.harness.fewshot_seed=7", "evaluate.harness.batch_size=4",
                   "evaluate.harness.num_fewshot=2", "evaluate.harness.dtype=bfloat16",
                   "evaluate.harness.max_length=64", "evaluate.harness.chat_template=true",
                   "evaluate.harness.tasks=[tiny_mc,tiny_docs]"):
        b = plan(load_config(None, [change], data=base))
        assert b["evaluate"].key != a["evaluate"].key, change
        assert b["quantize"].key != a["quantize"].key, change  # the gate re-runs the same evaluation
        assert b["pretrain"].key == a["pretrain"].key, change


def test_config_defaults_leave_the_harness_off() -> None:
    assert EvaluateConfig().harness.tasks == []


def reference_accuracy(model, tok, rows: list[dict]) -> tuple[float, float]:  # noqa: ANN001
    """(acc, byte-normalised acc) by hand: the sum of log p(choice tokens | context), float64, one
    sequence at a time; context and choice tokenized apart (llmpipe's removed scorer, kept as the
    reference the harness's numbers are checked against)."""
    hits = hits_bytes = 0
    for r in rows:
        ctx = tok(r["context"], add_special_tokens=False).input_ids
        lls = []
        for c in r["choices"]:
            ids = tok(c, add_special_tokens=False).input_ids
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([ctx + ids])).logits[0].double(), -1)
            lls.append(sum(float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(ids)))
        per_byte = [v / len(c.encode()) for v, c in zip(lls, r["choices"], strict=True)]
        hits += int(max(range(len(lls)), key=lls.__getitem__) == r["label"])
        hits_bytes += int(max(range(len(lls)), key=per_byte.__getitem__) == r["label"])
    return hits / len(rows), hits_bytes / len(rows)


def test_the_harness_accuracy_equals_a_by_hand_scorer_on_the_shipped_set(lm) -> None:  # noqa: ANN001
    # measured before llmpipe's own scorer was removed: ours and the harness's gave 0.4167 / 0.3125 here too
    from llmpipe.evaluation.metrics import load_task

    rows = load_task(BUILTIN_TASKS / "tiny_mc" / "tiny_mc.jsonl")
    theirs = run_harness(*lm, HarnessConfig(tasks=["tiny_mc"]))["tasks"]["tiny_mc"]["metrics"]
    acc, acc_bytes = reference_accuracy(*lm, rows)
    assert len(rows) == 48
    assert theirs["acc"] == acc and theirs["acc_bytes"] == acc_bytes


def test_evaluate_tasks_jsonl_runs_through_the_harness(lm, tmp_path: Path) -> None:  # noqa: ANN001
    from llmpipe.evaluation.config import TaskConfig

    rows = [{"context": "The teacher paints the red", "choices": [" river.", " ball."], "label": 1},
            {"context": "Die Katze sieht den roten", "choices": [" Ball.", " Fluss."], "label": 0},
            {"context": "My friend likes the old", "choices": [" tree.", " bird."], "label": 0},
            {"context": "Ein Kind malt ein kleines", "choices": [" Weg.", " Haus."], "label": 1},
            {"context": "A dog finds the", "choices": [" river.", " Haus."], "label": 0}]
    task = tmp_path / "cloze.jsonl"
    task.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = run_harness(*lm, HarnessConfig(), [TaskConfig(name="cloze", path=str(task), limit=4)])["tasks"]["cloze"]
    assert res["samples"] == 4 and res["source"] == "evaluate.tasks"  # limit: the first four lines
    assert res["metrics"]["acc"] == reference_accuracy(*lm, rows[:4])[0] >= 0.75  # the model learnt the templates


def test_chat_template_on_without_one_is_a_clear_error(lm) -> None:  # noqa: ANN001
    import copy

    from llmpipe.evaluation.harness import harness_lm

    model, tok = lm
    tok = copy.deepcopy(tok)  # the toy tokenizer ships a chat template now: this copy has none
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template: true, but the model's tokenizer has no chat template"):
        harness_lm(model, tok, HarnessConfig(tasks=["tiny_mc"], chat_template=True))
