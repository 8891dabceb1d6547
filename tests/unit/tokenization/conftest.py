"""Fixtures for the tokenization tests: a synthetic en/zh corpus, a stage context on a real store."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = ("the a river city house child runs quickly over under bright green small old new people "
         "market bread water stone light music winter summer road letter garden window").split()
HANZI = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处队南给色光门即保治北造百规热领七海口东导器压志世金增争济阶油思术极交受联什认六共权收证改清己美再采转更单风切打白教速花带安场身车例真务具万每目至达走积示议声报斗完类八离华名确才科张信马节话米整空元况今集温传土许步群广石记需段研界拉林律叫且究观越织装影算低持音众书布复容儿须际商非验连断深难近矿千周委素技备半办青省列习响约支般史感劳便团往酸历市克何除消构府称太准精值号率族维划选标写存候毛亲快效斯院查江型眼王按格养易置派层片始却专状育厂京识适属圆包火住调满县局照参红细引听该铁价严"


def _en_doc(rng: random.Random) -> str:
    sents = []
    for _ in range(rng.randint(1, 4)):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 14))]
        sents.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
    return " ".join(sents) + ("\n\nP.S. 42 émigrés 🎉 <|endoftext|>" if rng.random() < 0.1 else "")


def _zh_doc(rng: random.Random) -> str:
    return "".join("".join(rng.choice(HANZI) for _ in range(rng.randint(4, 20))) + "。"
                   for _ in range(rng.randint(1, 4)))


def synthetic_docs(n_en: int, n_zh: int, seed: int = 0, prefix: str = "d") -> list[Any]:
    """English (ASCII plus a few tricky characters) and Chinese documents, with lang and source set."""
    from llmpipe.document import Document

    rng = random.Random(seed)
    docs = [Document(f"{prefix}en{i}", _en_doc(rng), "web" if i % 3 else "books", {"lang": "en"})
            for i in range(n_en)]
    docs += [Document(f"{prefix}zh{i}", _zh_doc(rng), "wiki", {"lang": "zh"}) for i in range(n_zh)]
    rng.shuffle(docs)
    return docs


@pytest.fixture
def make_ctx(tmp_path: Path) -> Callable[..., Any]:
    """Build a StageContext for a registered stage with a real ArtifactStore under tmp_path."""
    from llmpipe.executor import LocalExecutor
    from llmpipe.stage import STAGES, StageContext
    from llmpipe.store import ArtifactStore

    def make(name: str, config: Any, inputs: dict[str, Path], out: Path, workers: int = 1,
             store_dir: Path | None = None, input_keys: dict[str, str] | None = None) -> StageContext:
        out.mkdir(parents=True, exist_ok=True)
        store = ArtifactStore(store_dir or tmp_path / "store")
        return StageContext(spec=STAGES[name], config=config, pipeline=None, key="test", out=out,
                            inputs=inputs, input_keys=input_keys or {k: f"key-{v}" for k, v in inputs.items()},
                            store=store, executor=LocalExecutor(workers))

    return make


@pytest.fixture
def synth() -> Callable[..., list[Any]]:
    return synthetic_docs


@pytest.fixture
def pipeline_dirs(tmp_path: Path, make_ctx: Callable[..., Any]) -> Callable[..., dict[str, Path]]:
    """Write docs as curated shards, train a tokenizer stage on them; returns the artifact dirs."""
    from llmpipe.document import write_shard
    from llmpipe.tokenization.config import TokenizerConfig
    from llmpipe.tokenization.tokenizer import run_tokenizer

    def build(shards: list[list[Any]], name: str = "a", vocab_size: int = 600) -> dict[str, Path]:
        aug = tmp_path / f"augment-{name}"
        for i, docs in enumerate(shards):
            write_shard(aug / "shards" / f"part-{i:03d}.parquet", docs)
        tok = tmp_path / f"tokenizer-{name}"
        run_tokenizer(make_ctx("tokenizer", TokenizerConfig(vocab_size=vocab_size), {"augment": aug}, tok))
        return {"augment": aug, "tokenizer": tok}

    return build
