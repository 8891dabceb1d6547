"""Supervised fine-tuning: render each pair with the tokenizer's chat template, learn the response only.

Our own short loop rather than TRL's ``SFTTrainer``: the one thing SFT adds to next-token training
is the loss mask, and here it is one function (:func:`encode_pair`) that the training loop, the
held-out response loss and the test on a hand-made batch all share; a tiny model on 2 CPU cores
then trains without the Trainer's accelerate / datasets setup (seconds of its own per run).
DPO, whose loss and reference bookkeeping are the subtle part, goes through TRL (``dpo.py``).
The same loop runs data parallel under torchrun (``sft.launch.nproc_per_node > 1``: ``sft_worker``,
DDP or FSDP2), each rank on its share of a step's pairs, with the single-process step's arithmetic.

A pair renders as ``apply_chat_template(prompt, add_generation_prompt=True)`` followed by the
response and the eos token: exactly what the chat endpoint sends the model and what it should answer
(``<|user|>\\n...<|endoftext|><|assistant|>\\n`` + response + ``<|endoftext|>``). Labels are -100
over the prompt, so only the response and its end-of-text are learned.

Packing (``sft.packing``, on by default): a step's pairs are laid end to end in rows of at most
``max_length`` tokens (first fit, longest first) instead of one padded row each. Each pair's position
ids restart at 0 and the model gets no 2-D attention mask: transformers (>= 4.5x, here 5.17) then
reads the packed layout from the position ids (``masking_utils.find_packed_sequence_indices``) and
builds a block-diagonal causal mask for SDPA / eager / flex (flash-attention 2 takes the same position
ids as ``cu_seqlens``), so no pair attends to another. A step sees the same pairs and the same
response tokens as without packing, so its loss is the same number (to float rounding); only the
padding computed goes. :func:`check_packing` verifies this on the model itself before training,
because ``sft.init_from`` may be an architecture that ignores packed position ids.
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


def pack(rows: list[tuple[list[int], list[int]]], seq_len: int) -> list[list[tuple[list[int], list[int]]]]:
    """Rows of at most ``seq_len`` tokens, each a list of whole pairs: first fit, longest pair first
    (a pair longer than ``seq_len`` cannot occur: :func:`encode_pair` cuts at ``max_length``)."""
    bins: list[list[tuple[list[int], list[int]]]] = []
    room: list[int] = []
    for row in sorted(rows, key=lambda r: -len(r[0])):
        n = len(row[0])
        for i, free in enumerate(room):
            if n <= free:
                bins[i].append(row)
                room[i] -= n
                break
        else:
            bins.append([row])
            room.append(seq_len - n)
    return bins


def collate_packed(bins: list[list[tuple[list[int], list[int]]]], pad_id: int) -> dict[str, Any]:
    """Packed tensors: input_ids, labels and position_ids restarting at 0 for each pair (and for the
    padding at a row's end, its own segment); no attention_mask, so the model builds the block mask."""
    import torch

    n = max(sum(len(x) for x, _ in b) for b in bins)
    ids = torch.full((len(bins), n), pad_id, dtype=torch.long)
    labels = torch.full((len(bins), n), IGNORE, dtype=torch.long)
    pos = torch.zeros((len(bins), n), dtype=torch.long)
    for i, b in enumerate(bins):
        at = 0
        for x, y in b:
            ids[i, at: at + len(x)] = torch.tensor(x)
            labels[i, at: at + len(y)] = torch.tensor(y)
            pos[i, at: at + len(x)] = torch.arange(len(x))
            at += len(x)
        pos[i, at:] = torch.arange(n - at)
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def batch_logits(model: Any, batch: dict[str, Any]) -> Any:
    """The logits of a padded (:func:`collate`) or packed (:func:`collate_packed`) batch."""
    inputs = {k: v.to(model.device) for k, v in batch.items() if k != "labels"}
    return model(**inputs, use_cache=False).logits


def check_packing(model: Any, atol: float = 1e-4) -> None:
    """Raise unless two random sequences packed in one row give each the logits it gets alone: the
    model reads packed position ids as separate sequences (see the module docstring)."""
    import torch

    g = torch.Generator().manual_seed(0)
    vocab_size = model.get_input_embeddings().num_embeddings
    a, b = (torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in (7, 5))
    was_training = model.training
    model.eval()
    with torch.no_grad():
        packed = batch_logits(model, collate_packed([[(a, a), (b, b)]], 0))[0]
        alone = [batch_logits(model, collate([(x, x)], 0))[0] for x in (a, b)]
    model.train(was_training)
    if not torch.allclose(packed, torch.cat(alone), atol=atol):
        raise ValueError(f"sft.packing: {type(model).__name__} lets packed samples attend to each other "
                         "(it does not read packed position ids); set sft.packing: false")


def padding_share(batches: list[list[int]]) -> float:
    """The share of computed token slots that are padding, for batches given as their rows' lengths."""
    slots = sum(len(b) * max(b) for b in batches)
    return 1 - sum(sum(b) for b in batches) / max(slots, 1)


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
            b = collate(rows[i: i + batch_size], tokenizer.pad_token_id)
            s, n = response_loss_terms(batch_logits(model, b), b["labels"].to(model.device))
            total, count = total + float(s), count + int(n)
    return total / max(count, 1)


def train(model: Any, tokenizer: Any, pairs: list[Pair], *, steps: int, batch_size: int, lr: float,
          weight_decay: float, max_length: int, seed: int, packing: bool = False,
          on_step: Callable[[int, float], None] | None = None,
          shapes: list[dict[str, Any]] | None = None, rank: int = 0, world: int = 1,
          wrap: Callable[[Any], Any] | None = None) -> list[dict[str, float]]:
    """AdamW on the response tokens, linear decay to 0 after 10% warmup; one record per step.

    ``packing`` packs each step's pairs (:func:`pack`); ``shapes``, when given, gets one record per
    step of the row lengths computed and of the pairs' own lengths (what padding would have cost).

    Data parallel (``world > 1``, under torchrun: ``sft_worker``): every rank draws the same global
    batch of ``batch_size`` pairs and computes pairs ``rank, rank + world, ...`` of it through
    ``wrap(model)`` (DDP or FSDP2, which average gradients over ranks). The response-token count is
    summed over ranks first and each rank's summed loss scaled by ``world / count``, so the averaged
    gradient is the gradient of the global batch's mean loss per response token: the single-process
    step, whatever the ranks' shares of tokens. ``shapes`` then records this rank's share."""
    import torch

    if packing:
        check_packing(model)
    torch.manual_seed(seed)
    rows = [encode_pair(tokenizer, p.messages, p.response, max_length) for p in pairs]
    gen = torch.Generator().manual_seed(seed)
    device = model.device
    net = wrap(model) if wrap is not None else model
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (steps - s) / max(1, steps - warm))))
    net.train()
    log = []
    order = torch.randperm(len(rows), generator=gen).tolist()
    pos = 0
    for step in range(1, steps + 1):
        if pos + batch_size > len(order):
            order, pos = torch.randperm(len(rows), generator=gen).tolist(), 0
        chosen = [rows[i] for i in order[pos: pos + batch_size]][rank::world]
        pos += batch_size
        bins = pack(chosen, max_length) if packing else [[r] for r in chosen]
        b = collate_packed(bins, tokenizer.pad_token_id) if packing else collate(chosen, tokenizer.pad_token_id)
        if shapes is not None:
            shapes.append({"rows": [sum(len(x) for x, _ in r) for r in bins], "pairs": [len(x) for x, _ in chosen]})
        logits = net(**{k: v.to(device) for k, v in b.items() if k != "labels"}, use_cache=False).logits
        s, n = response_loss_terms(logits, b["labels"].to(device))
        total_s, total_n = _summed(s.detach(), n, world)
        loss = s / total_n.clamp(min=1).to(s.dtype) * world  # world 1: exactly s / n
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        value = float(total_s / total_n.clamp(min=1))
        if not math.isfinite(value):
            raise FloatingPointError(f"sft: the loss is {value} at step {step}; lower sft.lr")
        log.append({"step": step, "loss": value, "lr": sched.get_last_lr()[0]})
        if on_step is not None:
            on_step(step, value)
    model.eval()
    return log


def _summed(loss_sum: Any, count: Any, world: int) -> tuple[Any, Any]:
    """(summed loss, response-token count) of the global batch: summed over the ranks when ``world > 1``."""
    import torch

    if world == 1:
        return loss_sum, count
    import torch.distributed as dist

    t = torch.stack([loss_sum.double(), count.double()])
    dist.all_reduce(t)
    return t[0], t[1]
