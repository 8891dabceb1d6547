"""Supervised fine-tuning: render each pair with the tokenizer's chat template, learn the response only.

Our own short loop rather than TRL's ``SFTTrainer``: the one thing SFT adds to next-token training
is the loss mask, and here it is one function (:func:`encode_pair`) that the training loop, the
held-out response loss and the test on a hand-made batch all share; a tiny model on 2 CPU cores
then trains without the Trainer's accelerate / datasets setup (seconds of its own per run).
DPO, whose loss and reference bookkeeping are the subtle part, goes through TRL (``dpo.py``).

A pair renders as ``apply_chat_template(prompt, add_generation_prompt=True)`` followed by the
response and the eos token: exactly what the chat endpoint sends the model and what it should answer
(``<|user|>\\n...<|endoftext|><|assistant|>\\n`` + response + ``<|endoftext|>``). Labels are -100
over the prompt, so only the response and its end-of-text are learned.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from llmpipe.posttrain.data import Messages, Pair

IGNORE = -100  # the label torch's cross-entropy skips


def render_prompt(tokenizer: Any, messages: Messages) -> str:
    """The prompt as the chat endpoint renders it: the template with the assistant's marker appended."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_pair(tokenizer: Any, messages: Messages, response: str, max_length: int) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one pair; labels are IGNORE on every prompt token."""
    prompt = tokenizer(render_prompt(tokenizer, messages), add_special_tokens=False)["input_ids"]
    answer = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt + answer)[:max_length]
    labels = ([IGNORE] * len(prompt) + answer)[:max_length]
    return ids, labels


def collate(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, Any]:
    """Right-padded tensors: input_ids, attention_mask, labels (IGNORE on padding)."""
    import torch

    n = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def response_loss_terms(logits: Any, labels: Any) -> tuple[Any, Any]:
    """(summed cross-entropy, number of targets) over the labels that are not IGNORE (shifted by one)."""
    import torch.nn.functional as F

    shift_logits, shift_labels = logits[:, :-1].float(), labels[:, 1:]
    loss = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    return loss, (shift_labels != IGNORE).sum()


def response_loss(model: Any, tokenizer: Any, pairs: list[Pair], max_length: int, batch_size: int = 32) -> float:
    """Mean cross-entropy per response token of ``pairs`` (nats): the held-out measure of SFT."""
    import torch

    rows = [encode_pair(tokenizer, p.messages, p.response, max_length) for p in pairs]
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            b = {k: v.to(model.device) for k, v in collate(rows[i: i + batch_size], tokenizer.pad_token_id).items()}
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            s, n = response_loss_terms(logits, b["labels"])
            total, count = total + float(s), count + int(n)
    return total / max(count, 1)


def train(model: Any, tokenizer: Any, pairs: list[Pair], *, steps: int, batch_size: int, lr: float,
          weight_decay: float, max_length: int, seed: int,
          on_step: Callable[[int, float], None] | None = None) -> list[dict[str, float]]:
    """AdamW on the response tokens, linear decay to 0 after 10% warmup; one record per step."""
    import torch

    torch.manual_seed(seed)
    rows = [encode_pair(tokenizer, p.messages, p.response, max_length) for p in pairs]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (steps - s) / max(1, steps - warm))))
    model.train()
    log = []
    order = torch.randperm(len(rows), generator=gen).tolist()
    pos = 0
    for step in range(1, steps + 1):
        if pos + batch_size > len(order):
            order, pos = torch.randperm(len(rows), generator=gen).tolist(), 0
        b = collate([rows[i] for i in order[pos: pos + batch_size]], tokenizer.pad_token_id)
        pos += batch_size
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        s, n = response_loss_terms(logits, b["labels"])
        loss = s / n.clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"sft: the loss is {value} at step {step}; lower sft.lr")
        log.append({"step": step, "loss": value, "lr": sched.get_last_lr()[0]})
        if on_step is not None:
            on_step(step, value)
    model.eval()
    return log
