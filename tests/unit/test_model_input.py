"""The ``model`` input: evaluate and quantize read the last active model stage (pretrain, sft, preference).

Planned from the real configs (tiny.yaml: keys as the fixed ``pretrain`` input gave them; tiny-chat.yaml:
the tuned model), and run on toy stages through ``llmpipe.dag.execute`` for what a stage receives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmpipe.config import load_config
from llmpipe.dag import PlannedStage, execute, plan, resolve_inputs, select
from llmpipe.executor import LocalExecutor
from llmpipe.pipeline import topological_order
from llmpipe.stage import MODEL, StageContext, StageSpec
from llmpipe.store import ArtifactStore, stage_key
from tests.conftest import ROOT

# what evaluate and quantize declared before the model input existed: tiny.yaml's keys must stay theirs
FIXED_INPUTS = {"evaluate": ("pretrain", "tokenize"), "quantize": ("pretrain", "tokenize", "evaluate")}


@pytest.fixture(scope="module")
def tiny() -> dict[str, PlannedStage]:
    return plan(load_config(ROOT / "configs" / "tiny.yaml"))


def test_tiny_yaml_keeps_the_keys_of_a_fixed_pretrain_input(tiny: dict[str, PlannedStage]) -> None:
    for name, fixed in FIXED_INPUTS.items():
        ps = tiny[name]
        assert ps.model_from == "pretrain" and ps.upstream == fixed and tuple(ps.input_keys) == fixed
        assert ps.key == stage_key(name, ps.spec.version, ps.key_config, {d: tiny[d].key for d in fixed})
    assert tiny["deploy"].input_keys == {"quantize": tiny["quantize"].key}
    assert [n for n, ps in tiny.items() if ps.model_from] == ["evaluate", "quantize"]


@pytest.mark.parametrize(("overrides", "model"), [([], "preference"), (["preference.enabled=false"], "sft")])
def test_with_post_training_evaluate_quantize_and_deploy_follow_the_tuned_model(
        tiny: dict[str, PlannedStage], overrides: list[str], model: str) -> None:
    chat = plan(load_config(ROOT / "configs" / "tiny-chat.yaml", overrides))
    order = list(chat)
    assert order.index(model) < order.index("evaluate") < order.index("quantize") < order.index("deploy")
    for name in ("evaluate", "quantize"):
        assert chat[name].model_from == model and chat[name].input_keys[model] == chat[model].key
        assert "pretrain" not in chat[name].input_keys and chat[name].key != tiny[name].key
    assert chat["deploy"].input_keys == {"quantize": chat["quantize"].key} != tiny["deploy"].input_keys
    assert all(chat[n].key == tiny[n].key for n in order[: order.index("pretrain") + 1])


def test_the_post_train_flow_is_sft_preference_evaluate() -> None:
    chat = plan(load_config(ROOT / "configs" / "tiny-chat.yaml"))
    assert [p.name for p in select(chat, "post_train")] == ["sft", "preference", "evaluate"]
    assert "evaluate" in [p.name for p in select(chat, "pretrain")]  # still pretrain's flow too
    assert [p.name for p in select(chat, "release")] == ["quantize", "deploy"]


def _toy(name: str, inputs: tuple[str, ...], model: bool = False) -> StageSpec:
    def fn(ctx: StageContext) -> dict[str, Any]:
        (ctx.out / "from").write_text(name)
        seen = {k: (Path(v) / "from").read_text() for k, v in ctx.inputs.items()}
        return {"seen": seen, "model_from": ctx.model_from}

    return StageSpec(name=name, version="1", inputs=inputs, config_field=None, flow="pretrain", fn=fn, model=model)


def test_a_model_input_comes_after_every_model_stage_and_reads_the_last_active_one(tmp_path: Path) -> None:
    # registered consumer first: the order still puts it after both model stages
    specs = {s.name: s for s in (_toy("judge", (MODEL, "data")), _toy("data", ()), _toy("base", ("data",), True),
                                 _toy("tuned", ("base",), True))}
    assert [s.name for s in topological_order(specs)] == ["data", "base", "tuned", "judge"]
    store, arts = ArtifactStore(tmp_path / "store"), {}
    active = [specs[n] for n in ("data", "base", "tuned")]
    for spec in active:
        ps = PlannedStage(spec, f"k-{spec.name}", None, {d: f"k-{d}" for d in spec.inputs})
        arts[spec.name] = execute(None, store, ps, arts, executor=LocalExecutor(1))[0]  # type: ignore[arg-type]
    for before, want in ((active, "tuned"), (active[:2], "base")):  # with the tuning stage off: the base model
        inputs, model_from = resolve_inputs(specs["judge"], before)
        assert (inputs, model_from) == ((want, "data"), want)
        ps = PlannedStage(specs["judge"], f"j-{want}", None, {d: f"k-{d}" for d in inputs}, {}, inputs, model_from)
        art = execute(None, store, ps, arts, executor=LocalExecutor(1))[0]  # type: ignore[arg-type]
        assert art.stats == {"seen": {want: want, "data": "data", MODEL: want}, "model_from": want}
    with pytest.raises(ValueError, match="'judge' takes the model, but no active stage before it makes one"):
        resolve_inputs(specs["judge"], [specs["data"]])


def test_status_shows_the_model_each_stage_reads(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flows.cli import main

    assert main(["status", str(ROOT / "configs" / "tiny-chat.yaml")]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["evaluate"][-1] == rows["quantize"][-1] == "preference"
    assert rows["pretrain"][-1] == rows["deploy"][-1] == "-"
