from pathlib import Path
from typing import Any, get_args, get_origin

import pytest

from llmpipe.config import RENAMED_KEYS, ConfigError, PipelineConfig, load_config, parse_override, renamed_key
from llmpipe.dag import plan
from tests.conftest import ROOT


def test_overrides_are_typed_and_dotted() -> None:
    cfg = load_config(None, ["ingest.normalization=NFKC", "executor.workers=3", "ingest.min_chars=5"])
    assert cfg.ingest.normalization == "NFKC"
    assert cfg.executor.workers == 3 and cfg.ingest.min_chars == 5
    assert parse_override("train.optimizer.lr=3e-4") == (["train", "optimizer", "lr"], 3e-4)
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])


def test_unknown_key_names_file_and_path(tmp_path: Path) -> None:
    p = tmp_path / "x.yaml"
    p.write_text("ingest:\n  normalisation: NFC\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert f"{p}: ingest.normalisation: unknown key" in str(e.value)


def test_bad_value_names_key_and_reason(tmp_path: Path) -> None:
    p = tmp_path / "x.yaml"
    p.write_text("ingest:\n  max_docs_per_shard: 0\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: ingest.max_docs_per_shard:") and "greater than 0" in msg and "got 0" in msg


def test_bad_override_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["ingest.min_chars"])
    p = tmp_path / "broken.yaml"
    p.write_text("ingest: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")


def test_duplicate_source_names_rejected() -> None:
    with pytest.raises(ConfigError, match="names must be unique"):
        load_config(None, data={"sources": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]})


def test_run_only_settings_do_not_change_keys(workdir: Path) -> None:
    base = {"sources": [{"name": "b", "path": "builtin:tiny"}]}
    a = plan(load_config(None, data=base))
    b = plan(load_config(None, ["executor.workers=7", "executor.dask_workers=5"], data=base))
    c = plan(load_config(None, ["ingest.normalization=NFKC"], data=base))
    assert {k: v.key for k, v in a.items()} == {k: v.key for k, v in b.items()}
    assert a["ingest"].key != c["ingest"].key
    # a changed stage changes every key after it, nothing before it
    names = list(a)
    assert all(a[n].key != c[n].key for n in names)


def test_tiny_config_is_valid() -> None:
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    assert cfg.sources and cfg.sources[0].path == "builtin:tiny"


def test_a_renamed_section_names_its_new_key() -> None:
    with pytest.raises(ConfigError, match=r"<config>: runner: renamed to 'executor'"):
        load_config(None, data={"runner": {"workers": 1}})


def test_a_moved_train_key_names_its_new_place(tmp_path: Path) -> None:
    """A config written for the flat ``train:`` gets one line per old key, naming where it lives now."""
    p = tmp_path / "old.yaml"
    p.write_text("train:\n  lr: 1.0e-3\n  checkpoint_every: 5\n  nproc_per_node: 1\n  schedule: constant\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, ["train.warmup_steps=3"])
    assert set(str(e.value).splitlines()) == {
        f"{p}: train.lr: moved to 'train.optimizer.lr'",
        f"{p}: train.checkpoint_every: moved to 'train.checkpoint.every'",
        f"{p}: train.nproc_per_node: moved to 'train.launch.nproc_per_node'",
        f"{p}: train.warmup_steps: moved to 'train.schedule.warmup_steps'",
        f"{p}: train.schedule: is a section now: write schedule: {{kind: constant}} (train.schedule.kind), "
        "got 'constant'",
    }


def test_renamed_keys_match_nested_and_list_locations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup takes the whole dotted path, with "[]" for a list entry (sources[].x)."""
    monkeypatch.setitem(RENAMED_KEYS, "sources[].file", "sources[].path")
    with pytest.raises(ConfigError) as e:
        load_config(None, data={"sources": [{"name": "a", "path": "x"}, {"name": "b", "file": "y"}]})
    assert "<config>: sources.1.file: moved to 'sources[].path'" in str(e.value).splitlines()
    assert renamed_key(("train", "launch", "nodes")) is None  # a new key is no old one
    assert renamed_key(("train", "nodes")) == "train.launch.nodes"


def test_every_renamed_key_points_at_a_key_that_exists() -> None:
    """The new name of each old key is a real key, and no old name is still one (else it never fires)."""
    def exists(path: str) -> bool:
        model: Any = PipelineConfig
        for part in path.replace("[]", "").split("."):
            field = getattr(model, "model_fields", {}).get(part)
            if field is None:
                return False
            model = field.annotation
            if get_origin(model) is list:
                model = get_args(model)[0]
        return True

    assert all(exists(new) and not exists(old) for old, new in RENAMED_KEYS.items()), RENAMED_KEYS
    assert len([k for k in RENAMED_KEYS if k.startswith("train.")]) == 25


def test_no_float_setting_defaults_to_an_int() -> None:
    """pydantic does not validate defaults: a ``float`` field defaulting to ``16`` stays the int 16 until
    the dumped config is validated again (a Prefect task does), where it becomes 16.0, and the canonical
    JSON of the two differs, so one config gave two shard-cache keys depending on how it ran."""
    import typing

    import pydantic

    from llmpipe.config import PipelineConfig

    bad: list[str] = []
    seen: set[type] = set()

    def walk(model: type[pydantic.BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, f in model.model_fields.items():
            args = typing.get_args(f.annotation) or (f.annotation,)
            if float in args and int not in args and type(f.default) is int:
                bad.append(f"{model.__name__}.{name} = {f.default!r}")
            for a in args:
                for b in typing.get_args(a) or (a,):
                    if isinstance(b, type) and issubclass(b, pydantic.BaseModel):
                        walk(b)

    walk(PipelineConfig)
    assert len(seen) > 20 and not bad, bad
