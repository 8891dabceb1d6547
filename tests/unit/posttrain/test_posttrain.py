"""Post-training: the SFT loss mask, the DPO loss against the paper and TRL, the data readers, the opt-in.

The model is the tiny random Llama of ``tests/fixtures/tiny_checkpoint.py`` (hidden 64) with the
project's own tokenizer and chat template; the end-to-end run of configs/tiny-chat.yaml is in
tests/e2e/test_post_training.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from llmpipe.config import ConfigError, load_config
from llmpipe.dag import check_extras, plan
from llmpipe.posttrain import data, dpo, sft
from llmpipe.posttrain.config import SftConfig
from tests.conftest import ROOT, write_jsonl
from tests.fixtures.tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("posttrain") / "ckpt")
    return path, AutoTokenizer.from_pretrained(path)


def test_sft_labels_cover_the_response_only(tiny: tuple[Path, object]) -> None:
    _, tok = tiny
    msgs = [{"role": "user", "content": "Say this word twice: river"}]
    ids, labels = sft.encode_pair(tok, msgs, "river river", 128)
    prompt = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt)] == prompt and labels[: len(prompt)] == [sft.IGNORE] * len(prompt)
    assert labels[len(prompt):] == ids[len(prompt):] and ids[-1] == tok.eos_token_id
    assert tok.decode(ids[len(prompt):], skip_special_tokens=True) == "river river"
    assert tok.decode(prompt).startswith("<|user|>\n") and tok.decode(prompt).endswith("<|assistant|>\n")


def test_sft_loss_ignores_prompt_logits_on_a_hand_made_batch() -> None:
    """Labels [-100, -100, 5, 7]: the loss is the CE of predicting 5 at position 1 and 7 at position 2;
    whatever the logits at the prompt's first position, it does not move."""
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 11)
    labels = torch.tensor([[sft.IGNORE, sft.IGNORE, 5, 7]])
    total, n = sft.response_loss_terms(logits, labels)
    lp = torch.log_softmax(logits, -1)
    assert int(n) == 2
    assert float(total) == pytest.approx(-(lp[0, 1, 5] + lp[0, 2, 7]).item(), rel=1e-6)
    changed = logits.clone()
    changed[0, 0] = torch.randn(11) * 10  # predicts the second prompt token: not a response target
    changed[0, 3] = torch.randn(11) * 10  # after the last token: nothing to predict
    assert float(sft.response_loss_terms(changed, labels)[0]) == pytest.approx(float(total), rel=1e-6)


def test_sft_padding_takes_no_loss(tiny: tuple[Path, object]) -> None:
    _, tok = tiny
    rows = [sft.encode_pair(tok, [{"role": "user", "content": "hi"}], "hello world", 128),
            sft.encode_pair(tok, [{"role": "user", "content": "a longer prompt here"}], "x", 128)]
    b = sft.collate(rows, tok.pad_token_id)
    assert int((b["labels"] != sft.IGNORE).sum()) == sum(sum(v != sft.IGNORE for v in y) for _, y in rows)
    assert int(b["attention_mask"].sum()) == sum(len(x) for x, _ in rows)


def test_dpo_loss_is_the_papers_formula_on_fixed_logits() -> None:
    """Summed completion log-probs from fixed logits, then -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))
    in plain floating point."""
    g = torch.Generator().manual_seed(3)
    target = torch.tensor([4, 1, 6])
    def logp(logits: torch.Tensor) -> float:
        return float(torch.log_softmax(logits, -1).gather(-1, target[:, None]).sum())
    pi_c, pi_r, ref_c, ref_r = (logp(torch.randn(3, 8, generator=g) * 2) for _ in range(4))
    for beta in (0.1, 0.5, 2.0):
        z = beta * ((pi_c - ref_c) - (pi_r - ref_r))
        paper = -math.log(1 / (1 + math.exp(-z)))
        ours = dpo.dpo_loss(*(torch.tensor(v, dtype=torch.float64) for v in (pi_c, pi_r, ref_c, ref_r)), beta)
        assert float(ours) == pytest.approx(paper, rel=1e-12)


@pytest.mark.slow
def test_trls_dpo_loss_equals_the_formula_on_fixed_models(tiny: tuple[Path, object], tmp_path: Path) -> None:
    """TRL's DPOTrainer on one batch of fixed policy and reference models (different weights) gives the
    paper's loss computed from our own completion log-probabilities of the same rendered pairs."""
    from transformers import AutoModelForCausalLM

    path, tok = tiny
    policy = AutoModelForCausalLM.from_pretrained(path)
    ref = make_tiny_checkpoint(tmp_path / "ref", seed=1)
    ref_model = AutoModelForCausalLM.from_pretrained(ref)
    prefs = data.builtin_preferences()[::40][:8]
    trainer = dpo.make_trainer(policy, ref_model, tok, prefs, out_dir=tmp_path / "run", steps=1,
                               batch_size=len(prefs), lr=1e-3, beta=0.3, max_length=128, seed=0)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        trl_loss = float(trainer.compute_loss(trainer.model, batch))
    pi = dpo.pair_logps(policy, tok, prefs, 128)
    ref_lp = dpo.pair_logps(ref_model, tok, prefs, 128)
    ours = float(dpo.dpo_loss(pi[0], pi[1], ref_lp[0], ref_lp[1], 0.3).mean())
    assert abs(ours - math.log(2)) > 0.05  # the two models differ: not the trivial policy == reference value
    assert trl_loss == pytest.approx(ours, rel=1e-4)


def test_builtin_sets_are_deterministic_multilingual_and_split_stably() -> None:
    pairs, prefs = data.builtin_instructions(), data.builtin_preferences()
    assert len(pairs) == len(prefs) == 320 and pairs == data.builtin_instructions()
    assert len({p.prompt for p in pairs}) == 320
    assert {"Großbuchstaben", "majuscules", "mayúsculas", "capitals"} <= {w for p in pairs for w in
                                                                        p.prompt[0][1].replace(":", " ").split()}
    assert all(p.chosen != p.rejected and p.chosen.split()[0] == p.rejected.split()[0] for p in prefs)
    train, held = data.split(pairs, 0.1)
    assert 15 < len(held) < 50 and not {p.prompt for p in train} & {p.prompt for p in held}
    assert data.split(pairs, 0.1) == (train, held)


def test_readers_take_jsonl_parquet_and_datasets_folders(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p1", "response": "r1"},
                                       {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "p2"},
                                                     {"role": "assistant", "content": "r2"}]}])
    pq.write_table(pa.Table.from_pylist([{"prompt": "p3", "response": "r3"}]), tmp_path / "b.parquet")
    Dataset.from_list([{"prompt": "p4", "response": "r4"}]).save_to_disk(str(tmp_path / "ds"))
    pairs = data.load_pairs(["a.jsonl", "b.parquet", "ds"], tmp_path)
    assert [(p.prompt, p.response) for p in pairs] == [
        ((("user", "p1"),), "r1"), ((("system", "s"), ("user", "p2")), "r2"), ((("user", "p3"),), "r3"),
        ((("user", "p4"),), "r4")]
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "good", "rejected": "bad"}])
    assert data.load_preferences(["p.jsonl"], tmp_path)[0].chosen == "good"


@pytest.mark.parametrize(("record", "message"), [
    ({"prompt": "p"}, ":2: key 'response' must be a non-empty string (missing)"),
    ({"messages": [{"role": "user", "content": "p"}]}, ":2: key 'messages' must end with the assistant's"),
    ({"messages": [{"role": "bot", "content": "p"}]}, ":2: messages[0] must be {role"),
    ({"text": "p"}, ":2: an instruction record needs 'prompt' and 'response', or 'messages'"),
])
def test_bad_records_name_the_file_line_and_key(tmp_path: Path, record: dict, message: str) -> None:
    write_jsonl(tmp_path / "x.jsonl", [{"prompt": "ok", "response": "ok"}, record])
    with pytest.raises(data.PostTrainDataError) as e:
        data.load_pairs(["x.jsonl"], tmp_path)
    assert str(tmp_path / "x.jsonl") + message in str(e.value)


def test_post_training_is_off_unless_the_config_turns_it_on() -> None:
    tiny = plan(load_config(ROOT / "configs" / "tiny.yaml"))
    assert "sft" not in tiny and "preference" not in tiny
    chat = plan(load_config(ROOT / "configs" / "tiny-chat.yaml"))
    assert chat["sft"].input_keys["pretrain"] == tiny["pretrain"].key and "sft.data" in chat["sft"].input_keys
    assert chat["preference"].input_keys["sft"] == chat["sft"].key
    # everything up to pretrain: tiny.yaml's keys; evaluate, quantize, deploy take the tuned model
    # (tests/unit/test_model_input.py)
    assert all(chat[n].key == tiny[n].key for n in tiny if n not in ("evaluate", "quantize", "deploy"))
    with pytest.raises(ValueError, match="--until sft: the stage is off in this config"):
        check_extras(load_config(ROOT / "configs" / "tiny.yaml"), until="sft")
    with pytest.raises(ConfigError, match="preference.enabled: DPO starts from the sft model"):
        load_config(ROOT / "configs" / "tiny.yaml", ["preference.enabled=true"])


def test_the_key_follows_the_datas_bytes_not_only_its_path(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "i.jsonl", [{"prompt": "p", "response": "r"}])
    overrides = ["sft.enabled=true", f"sft.data=[{tmp_path / 'i.jsonl'}]"]
    first = plan(load_config(ROOT / "configs" / "tiny.yaml", overrides))["sft"].key
    assert plan(load_config(ROOT / "configs" / "tiny.yaml", overrides))["sft"].key == first
    write_jsonl(tmp_path / "i.jsonl", [{"prompt": "p", "response": "r2"}])
    assert plan(load_config(ROOT / "configs" / "tiny.yaml", overrides))["sft"].key != first


def test_decontamination_removes_planted_copies_of_evaluation_items(tmp_path: Path) -> None:
    """Copies of built-in evaluation items planted in instruction and preference records (a tiny_docs
    passage inside a prompt, a whole tiny_cloze sentence as a response, a tiny_mc item with its answer in
    a chosen text, a zh document's characters) are dropped; the built-in sets and near-misses stay."""
    from llmpipe.posttrain.decontaminate import builtin_eval_texts, decontaminate

    evals = builtin_eval_texts()
    assert len(evals) == 100  # 48 tiny_mc, 40 tiny_cloze, 12 tiny_docs
    doc = "The village market opens at seven on Saturday mornings."
    cloze = "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday"
    zh = next(t for t in evals if "\u4e00" <= t[0] <= "\u9fff")
    write_jsonl(tmp_path / "i.jsonl", [
        {"prompt": f"Summarise: {doc.upper()}", "response": "A market."},
        {"prompt": "List the days.", "response": cloze + "."},
        {"prompt": "Continue", "response": zh[3:20]},
        {"prompt": "Keep me: the market opens at seven", "response": "fine"},  # 6 words of it, not 8
    ])
    pairs = data.builtin_instructions() + data.load_pairs(["i.jsonl"], tmp_path)
    kept, removed = decontaminate(pairs, 8)
    assert removed == 3 and kept == pairs[:320] + pairs[-1:]
    write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "Finish", "chosen": "To keep the bread fresh, she put it in a paper bag.", "rejected": "no"},
        {"prompt": "Finish", "chosen": "yes", "rejected": "no"}])
    prefs = data.load_preferences(["p.jsonl"], tmp_path)
    assert decontaminate(prefs, 8) == (prefs[1:], 1)
    assert decontaminate(data.builtin_preferences(), 8)[1] == 0


def test_the_stage_counts_what_decontamination_removed() -> None:
    from llmpipe.posttrain.curate import curate
    from llmpipe.posttrain.decontaminate import decontaminate

    pairs = [data.Pair((("user", "Say: once upon a time, numbers one two three four five six seven"),), "ok")]
    evals = ["once upon a time, numbers one two three four five six seven eight"]
    assert decontaminate(pairs, 8, evals) == ([], 1)
    cfg = SftConfig().curation.model_copy(update={"langid": None, "quality": None, "safety": None})
    kept, rejected, _ = curate([("x.jsonl:1", pairs[0])], [], cfg, None)
    assert kept == [("x.jsonl:1", pairs[0])] and rejected == []


def test_evaluate_measures_a_tuned_model_on_the_stages_held_out_pairs(tiny: tuple[Path, object],
                                                                      tmp_path: Path) -> None:
    """What evaluate adds for a DPO model: accuracy and reward margin on the preference stage's held-out
    pairs (read back from the stage's curation/kept.jsonl: reference-free, beta times the log-likelihood
    margin), chat samples through the template."""
    from transformers import AutoModelForCausalLM

    from llmpipe.posttrain import curate as cur
    from llmpipe.posttrain.data import read_records, split
    from llmpipe.posttrain.stage import SAMPLE_PROMPTS, tuned_measures

    path, tok = tiny
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = load_config(ROOT / "configs" / "tiny-chat.yaml", ["preference.held_out=0.05"])
    records, bad = read_records(cfg.preference.data, cfg.base_dir(), "preferences")
    kept, rejected, pii = cur.curate(records, bad, cfg.preference.curation, cfg.preference.decontaminate_ngram)
    cur.write(tmp_path, len(records) + len(bad), kept, rejected, pii)  # what the preference stage writes
    held = split([item for _w, item in kept], cfg.preference.held_out)[1]
    got = tuned_measures(cfg, "preference", tmp_path, model, tok)
    c, r = dpo.pair_logps(model, tok, held, cfg.preference.max_length)
    assert got["held_out_pairs"] == len(held) > 0
    assert got["preference_accuracy"] == pytest.approx(float((c > r).double().mean()))
    assert got["reward_margin"] == pytest.approx(cfg.preference.beta * float((c - r).mean()))
    assert [s["prompt"] for s in got["chat_samples"]] == [p.prompt[-1][1] for p in held[:SAMPLE_PROMPTS]]
    records, bad = read_records(cfg.sft.data, cfg.base_dir(), "instructions")
    kept, rejected, pii = cur.curate(records, bad, cfg.sft.curation, cfg.sft.decontaminate_ngram)
    cur.write(tmp_path / "sft", len(records) + len(bad), kept, rejected, pii)
    sft_only = tuned_measures(cfg, "sft", tmp_path / "sft", model, tok)  # no preference pairs for an sft model: samples only
    assert "preference_accuracy" not in sft_only and len(sft_only["chat_samples"]) == SAMPLE_PROMPTS
