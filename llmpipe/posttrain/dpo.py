"""Preference tuning with DPO (Rafailov et al., 2023) through TRL's ``DPOTrainer`` (TRL 1.16).

TRL is the field's reference implementation: it tokenizes conversational records with the
tokenizer's own chat template, keeps the reference model frozen and computes the sigmoid loss
``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` on summed completion log-probabilities.
:func:`dpo_loss` writes that formula out; the tests check TRL's loss against it on fixed models.

The held-out measures are ours, on the same rendering TRL trains on: a completion is the chosen or
rejected answer plus end-of-text after ``apply_chat_template(prompt, add_generation_prompt=True)``.
Preference accuracy is the share of pairs whose chosen answer the model finds more likely than the
rejected one; the reward margin is the mean ``beta * ((pi_c - ref_c) - (pi_r - ref_r))`` against
the frozen reference (0 for the reference itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmpipe.posttrain.data import Preference
from llmpipe.posttrain.sft import IGNORE, collate, encode_pair


def dpo_loss(pi_c: Any, pi_r: Any, ref_c: Any, ref_r: Any, beta: float) -> Any:
    """The paper's per-pair loss on summed completion log-probabilities (tensors)."""
    import torch.nn.functional as F

    return -F.logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))


def completion_logps(model: Any, tokenizer: Any, items: list[tuple[Any, str]], max_length: int,
                     batch_size: int = 32) -> list[float]:
    """Summed log-probability of each completion (+ eos) after its rendered prompt, for (messages, text)."""
    import torch

    rows = [encode_pair(tokenizer, m, text, max_length) for m, text in items]
    out: list[float] = []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            b = {k: v.to(model.device) for k, v in collate(rows[i: i + batch_size], tokenizer.pad_token_id).items()}
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1].float()
            labels = b["labels"][:, 1:]
            mask = labels != IGNORE
            lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            out += (lp * mask).sum(-1).cpu().tolist()
    return out


def pair_logps(model: Any, tokenizer: Any, prefs: list[Preference], max_length: int) -> tuple[Any, Any]:
    """(chosen, rejected) summed log-probabilities as float tensors."""
    import torch

    chosen = completion_logps(model, tokenizer, [(p.messages, p.chosen) for p in prefs], max_length)
    rejected = completion_logps(model, tokenizer, [(p.messages, p.rejected) for p in prefs], max_length)
    return torch.tensor(chosen, dtype=torch.float64), torch.tensor(rejected, dtype=torch.float64)


def preference_stats(model: Any, ref: tuple[Any, Any], tokenizer: Any, prefs: list[Preference], beta: float,
                     max_length: int) -> dict[str, float]:
    """Accuracy (chosen more likely than rejected), reward margin and DPO loss against ``ref``'s logps."""
    pi_c, pi_r = pair_logps(model, tokenizer, prefs, max_length)
    ref_c, ref_r = ref
    margin = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    return {"accuracy": float((pi_c > pi_r).double().mean()), "reward_margin": float(margin.mean()),
            "reward_accuracy": float((margin > 0).double().mean()),
            "loss": float(dpo_loss(pi_c, pi_r, ref_c, ref_r, beta).mean())}


def records(prefs: list[Preference]) -> list[dict[str, Any]]:
    """TRL's conversational preference format: prompt messages, chosen and rejected assistant turns."""
    return [{"prompt": p.messages, "chosen": [{"role": "assistant", "content": p.chosen}],
             "rejected": [{"role": "assistant", "content": p.rejected}]} for p in prefs]


def make_trainer(model: Any, ref_model: Any, tokenizer: Any, prefs: list[Preference], *, out_dir: Path,
                 steps: int, batch_size: int, lr: float, beta: float, max_length: int, seed: int) -> Any:
    """TRL's DPOTrainer, set up for a short deterministic CPU run that writes nothing but logs."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=lr,
        lr_scheduler_type="linear", warmup_steps=0, beta=beta, max_length=max_length, seed=seed,
        data_seed=seed, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, dataset_num_proc=None, use_cpu=not _cuda(), bf16=False, fp16=False)
    return DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=Dataset.from_list(records(prefs)),
                      processing_class=tokenizer)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
