"""The streaming model's send thread: when sends fall behind, one stream's waiting tokens leave as
one response, and what each client reads (text, ids, final flag, order) is what it would read
token by token."""

from __future__ import annotations

import threading
import time
from typing import Any

from llmpipe.serving.triton_model import Outbox, Tokens, coalesce

FINAL = 1


class _Stream:
    def __init__(self) -> None:
        self.broken = False


class _Sender:
    """Records each send; the first one blocks until ``release`` is set (a slow server)."""

    def __init__(self, release: threading.Event, log: list[tuple[Any, Any, int]], fail: bool = False) -> None:
        self.release, self.log, self.fail = release, log, fail

    def send(self, response: Any = None, flags: int = 0) -> None:
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("client went away")
        self.log.append((self, response, flags))


def _tokens(text: str, *ids: int) -> Tokens:
    return Tokens(text, list(ids))


def test_coalesce_merges_one_streams_tokens_and_moves_nothing_past_other_sends() -> None:
    a, b = _Stream(), _Stream()
    items = [(a, "sa", _tokens("x", 1), 0), (b, "sb", _tokens("p", 7), 0), (a, "sa", _tokens("y", 2), 0),
             (b, "sb", "error", FINAL), (a, "sa", _tokens("z", 3), FINAL), (a, "sa", _tokens("!", 4), 0)]
    out = coalesce(items)
    assert [(s, r.text if isinstance(r, Tokens) else r, f) for s, _, r, f in out] == [
        (a, "xyz", FINAL), (b, "p", 0), (b, "error", FINAL), (a, "!", 0)]  # a's final closed its merge
    assert out[0][2].ids == [1, 2, 3]
    close = [(a, "sa", _tokens("x", 1), 0), (a, "sa", None, FINAL), (a, "sa", _tokens("y", 2), 0)]
    assert [r for _, _, r, _ in coalesce(close)] == [close[0][2], None, close[2][2]]  # a close is not merged into
    stop = [(a, "sa", _tokens("x", 1), 0), (None, None, None, 0), (a, "sa", _tokens("y", 2), 0)]
    assert len(coalesce(stop)) == 2  # nothing after the stop marker


def test_a_slow_send_merges_the_tokens_that_wait_behind_it() -> None:
    release, log = threading.Event(), []
    outbox = Outbox(on_broken=lambda s: None, respond=lambda text, ids: (text, ids))
    a, b = _Stream(), _Stream()
    sa, sb = _Sender(release, log), _Sender(release, log)
    outbox.put(a, sa, _tokens("he", 10), 0)
    time.sleep(0.2)  # the thread took it and is stuck in its send
    for i, piece in enumerate(["ll", "o", " w"]):
        outbox.put(a, sa, _tokens(piece, 11 + i), 0)
        outbox.put(b, sb, _tokens(str(i), 20 + i), FINAL if i == 2 else 0)
    outbox.put(a, sa, _tokens("orld", 14), FINAL)
    release.set()
    outbox.close()
    by = {sa: [], sb: []}
    for sender, response, flags in log:
        by[sender].append((response, flags))
    assert by[sa] == [(("he", [10]), 0), (("llo world", [11, 12, 13, 14]), FINAL)]
    assert by[sb] == [(("012", [20, 21, 22]), FINAL)]
    assert len(log) == 3  # 9 tokens in 3 sends


def test_a_failed_send_breaks_only_its_stream() -> None:
    release, log, broken = threading.Event(), [], []
    release.set()
    outbox = Outbox(on_broken=broken.append, respond=lambda text, ids: (text, ids))
    a, b = _Stream(), _Stream()
    sa = _Sender(release, log, fail=True)
    outbox.put(a, sa, _tokens("x", 1), 0)
    time.sleep(0.2)  # sent (and failed) before the next ones are put
    outbox.put(b, _Sender(release, log), _tokens("y", 2), FINAL)
    outbox.put(a, sa, _tokens("z", 3), FINAL)  # dropped: its stream broke
    outbox.close()
    assert broken == [a] and a.broken and [r for _, r, _ in log] == [("y", [2])]


def test_a_running_streams_next_tokens_linger_and_leave_together_but_its_first_token_does_not_wait() -> None:
    release, log = threading.Event(), []
    release.set()
    times: list[float] = []

    def on_send(stream: Any, tokens: bool, flags: int) -> None:
        stream.responses += tokens
        times.append(time.monotonic())

    outbox = Outbox(on_broken=lambda s: None, respond=lambda text, ids: (text, ids), on_send=on_send, linger_s=0.4)
    a, sa = _Stream(), _Sender(release, log)
    a.responses = 0  # type: ignore[attr-defined]
    put_at = time.monotonic()
    outbox.put(a, sa, _tokens("he", 10), 0)
    while not log and time.monotonic() < put_at + 5:
        time.sleep(0.005)
    assert times[0] - put_at < 0.2  # a first token leaves at once
    for i, piece in enumerate(["ll", "o", " w"]):
        outbox.put(a, sa, _tokens(piece, 11 + i), 0)
    while len(log) < 2 and time.monotonic() < put_at + 5:
        time.sleep(0.005)
    assert times[1] - times[0] >= 0.35  # the next ones waited for the linger, then left as one response
    outbox.put(a, sa, _tokens("orld", 14), FINAL)  # a last token ends a linger: sent at once
    outbox.close()
    assert [(r, f) for _, r, f in log] == [(("he", [10]), 0), (("llo w", [11, 12, 13]), 0), (("orld", [14]), FINAL)]
    assert times[2] - times[1] < 0.35


def test_a_new_streams_first_token_ends_a_linger_under_way() -> None:
    release, log = threading.Event(), []
    release.set()
    times: list[float] = []

    def on_send(stream: Any, tokens: bool, flags: int) -> None:
        stream.responses += tokens
        times.append(time.monotonic())

    outbox = Outbox(on_broken=lambda s: None, respond=lambda text, ids: (text, ids), on_send=on_send, linger_s=5.0)
    a, b, sa, sb = _Stream(), _Stream(), _Sender(release, log), _Sender(release, log)
    a.responses = b.responses = 0  # type: ignore[attr-defined]
    outbox.put(a, sa, _tokens("he", 10), 0)
    started = time.monotonic()
    while not log and time.monotonic() < started + 5:
        time.sleep(0.005)
    outbox.put(a, sa, _tokens("ll", 11), 0)  # lingers: a had its first response
    time.sleep(0.2)
    put_at = time.monotonic()
    outbox.put(b, sb, _tokens("x", 20), 0)  # b's first token: sent now, a's waiting tokens with it
    while len(log) < 3 and time.monotonic() < put_at + 5:
        time.sleep(0.005)
    assert times[-1] - put_at < 1.0
    outbox.put(a, sa, _tokens("o", 12), FINAL)
    outbox.put(b, sb, _tokens("y", 21), FINAL)
    outbox.close()
    assert sorted((r, f) for _, r, f in log) == sorted([(("he", [10]), 0), (("ll", [11]), 0), (("x", [20]), 0),
                                                        (("o", [12]), FINAL), (("y", [21]), FINAL)])


def test_a_first_token_put_during_a_round_goes_before_the_rest_of_it() -> None:
    release, log = threading.Event(), []
    outbox = Outbox(on_broken=lambda s: None, respond=lambda text, ids: (text, ids))
    running = [_Stream() for _ in range(3)]
    for s in running:
        s.responses = 1  # type: ignore[attr-defined]  # each had its first response: its next tokens queue
    senders = [_Sender(release, log) for _ in running]
    for i, (s, sender) in enumerate(zip(running, senders, strict=True)):
        outbox.put(s, sender, _tokens(str(i), i), 0)
    time.sleep(0.2)  # the round is under way, stuck in its first send
    new, new_sender = _Stream(), _Sender(release, log)
    outbox.put(new, new_sender, _tokens("n", 9), 0)  # a newcomer's first token
    outbox.put(new, new_sender, _tokens("m", 10), FINAL)  # and its next: still before the round's rest
    release.set()
    outbox.close()
    assert [(sender, r) for sender, r, _ in log] == [
        (senders[0], ("0", [0])), (new_sender, ("nm", [9, 10])), (senders[1], ("1", [1])), (senders[2], ("2", [2]))]
