"""The shipped tiny preset declares valid augment/tokenizer/tokenize sections and the stages are in the DAG."""

from __future__ import annotations

from pathlib import Path

from llmpipe.config import load_config
from llmpipe.curation.augment.config import RestructureOp, SynonymOp, TemplateOp
from llmpipe.pipeline import load_stages

ROOT = Path(__file__).resolve().parents[3]


def test_tiny_preset_sections_validate() -> None:
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    assert cfg.augment.enabled and {type(op) for op in cfg.augment.operators} == {SynonymOp, RestructureOp,
                                                                                   TemplateOp}
    assert cfg.tokenize.val_fraction > 0 and cfg.tokenizer.vocab_size >= 260


def test_stages_registered_in_order() -> None:
    order = list(load_stages())
    assert order.index("dedup") < order.index("augment") < order.index("tokenizer") < order.index("tokenize")
    stages = load_stages()
    assert stages["tokenize"].inputs == ("augment", "tokenizer") and stages["augment"].flow == "data_refresh"


def test_run_settings_stay_out_of_the_key() -> None:
    a = load_config(ROOT / "configs" / "tiny.yaml", ["tokenize.batch_size=7"])
    b = load_config(ROOT / "configs" / "tiny.yaml")
    assert a.tokenize.key_dict() == b.tokenize.key_dict()
    c = load_config(ROOT / "configs" / "tiny.yaml", ["tokenize.seq_len=64"])
    assert c.tokenize.key_dict() != b.tokenize.key_dict()
