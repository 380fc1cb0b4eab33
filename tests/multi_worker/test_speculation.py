"""The inline fingerprint's arithmetic and the layout predictor (no process group)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from crossdevice._comm.workers.speculation import (  # noqa: E402
    INLINE_SLOTS,
    MAX_INLINE_WORKERS,
    Predictor,
    RoomPool,
    inline_agrees,
    inline_header,
    speculative_ops,
)


def _header(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 40, 84)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
@pytest.mark.parametrize("world", [2, 3, MAX_INLINE_WORKERS])
def test_inline_check_passes_only_when_every_digest_is_equal(dtype: object, world: int) -> None:
    mine = inline_header(_header(0))
    same = torch.tensor(mine, dtype=dtype) * world
    assert inline_agrees(same, mine, world)
    for other_seed in range(1, 30):
        other = inline_header(_header(other_seed))
        summed = torch.tensor(mine, dtype=dtype) * (world - 1) + torch.tensor(other, dtype=dtype)
        assert not inline_agrees(summed, mine, world)
        # The peer's view: its own digest against the same sums.
        assert not inline_agrees(summed, other, world)


def test_inline_sums_are_exact_in_float32() -> None:
    # The largest sum the check can meet: 256 workers of 255**2.
    assert float(np.float32(MAX_INLINE_WORKERS * 255**2)) == MAX_INLINE_WORKERS * 255**2
    assert MAX_INLINE_WORKERS * 255**2 < 2**24
    assert len(inline_header(_header(1))) == INLINE_SLOTS


def test_predictor_learns_what_follows_each_agreed_collective() -> None:
    p = Predictor()
    a, b = [_header(1)] * 2, [_header(2)] * 2
    layout = ((torch.float32, 6),)
    assert p.predict() is None
    p.learn(a, None)
    p.learn(b, layout)  # after a came b, an all-reduce of layout
    p.learn(a, None)  # after b came a (not predicted: its layout is None)
    assert p.predict() == layout
    b2 = [row.copy() for row in b]
    for row in b2:
        row[1] += 7  # another sequence number is the same history
    p.learn(b2, layout)
    assert p.predict() is None
    # Layouts that cannot carry an inline header are never predicted.
    p.learn(a, ((torch.float16, 6),))
    p.learn(b, None)
    assert p.predict() is None


def _replay(p: Predictor, cycle: list[tuple[int, Any]], cycles: int) -> list[bool]:
    """Learn `cycle` (header seeds and layouts) `cycles` times; per call, whether the
    layout predicted just before it was its own (calls with no layout predicted: None)."""
    right = []
    for _ in range(cycles):
        for seed, layout in cycle:
            right.append(p.predict() == layout)
            p.learn([_header(seed)] * 2, layout)
    return right


def test_a_run_of_identical_collectives_is_predicted_at_every_position() -> None:
    # A step whose buckets share one layout and signature (identical layers): K K K.
    small, large = ((torch.float32, 6),), ((torch.float32, 9),)
    cycle = [(1, None), (2, small), (2, small), (2, small), (3, large)]
    p = Predictor()
    right = _replay(p, cycle, 4)
    assert all(right[2 * len(cycle) :])  # from the third step on, every guess is right
    guesses, misses = p.guesses, p.misses
    assert _replay(p, cycle, 3) == [True] * 3 * len(cycle)
    assert p.misses == misses  # `counted` is the caller's: the replay counts nothing
    assert p.guesses == guesses


def test_what_follows_a_collective_is_told_apart_by_the_one_before() -> None:
    # a b a c a b a c ...: after a comes b or c, depending on what came before a.
    lb, lc = ((torch.float32, 4),), ((torch.float64, 5),)
    cycle = [(1, None), (2, lb), (1, None), (3, lc)]
    assert all(_replay(Predictor(), cycle, 5)[2 * len(cycle) :])


@pytest.mark.parametrize("extra", [1, 5, 64, 200])
def test_a_run_longer_than_max_run_is_predicted_at_every_position(extra: int) -> None:
    # An epoch of a one-bucket model: the has-data agreement, then the same bucket once a
    # step (128 steps of 8 examples), then the next epoch's agreement.
    from crossdevice._comm.workers.speculation import MAX_RUN

    layout, other = ((torch.float32, 6),), ((torch.float32, 7),)
    cycle = [(1, None)] + [(2, layout)] * (MAX_RUN + extra) + [(3, other)]
    right = _replay(Predictor(), cycle, 3)[len(cycle) :]
    assert all(right)  # from the second cycle on


def test_runs_past_max_run_of_several_lengths_are_each_predicted() -> None:
    # Two contexts run past MAX_RUN, each ending at lengths of its own.
    from crossdevice._comm.workers.speculation import MAX_RUN

    a, b = ((torch.float32, 6),), ((torch.float32, 7),)
    cycle = (
        [(1, None)] + [(2, a)] * (MAX_RUN + 3) + [(3, b)] + [(2, a)] * (MAX_RUN + 9) + [(4, None)]
    )
    right = _replay(Predictor(), cycle, 3)[len(cycle) + 1 :]
    assert all(right)  # after the first cycle and the call that follows it


def test_an_odd_one_out_that_does_not_come_again_is_forgotten() -> None:
    # A has-data agreement every step (a dataset of no exact length) is an anchor every
    # step, so each context is at its first occurrence every time: what followed the
    # epoch's last step must not be guessed at every step after it.
    bucket, last = ((torch.float32, 6),), ((torch.float32, 9),)
    step = [(1, None), (2, bucket)]
    epoch = step * 5 + [(1, None), (3, last)]
    right = _replay(Predictor(), epoch, 4)
    # Per epoch from the third: the odd last step, then the step after it, guessed
    # wrong once each at most (as a predictor without odd ones out does); every other
    # call right.
    for e in range(2, 4):
        assert right[e * len(epoch) : (e + 1) * len(epoch)].count(False) <= 2, right


def test_a_tag_that_cycles_with_the_step_count_is_not_history() -> None:
    # The gradients' call site carries the step count modulo 4 (`purpose` tag, in the
    # structure digest): with it in the history an epoch of 10 steps ended after a
    # bucket that also came mid-epoch, and its end was guessed wrong every epoch.
    from crossdevice._comm.workers import fingerprint as fp

    layout = ((torch.float32, 6),)

    def header(kind: str, structure: int, seq: int) -> np.ndarray:
        shapes = 5 if kind == "all_reduce" else 0
        return fp.Fingerprint(seq, kind, "sum", 1, 1, 24, 3, shapes, structure).encode()

    p = Predictor()
    seq = 0
    right = []
    for _ in range(4):  # epochs
        for step in range(-1, 10):
            seq += 1
            made = None if step < 0 else layout  # the has-data agreement, then 10 steps
            kind = "has_data" if step < 0 else "all_reduce"
            right.append(p.predict() == made)
            p.learn([header(kind, 1000 + (max(step, 0) & 3), seq)] * 2, made)
    assert all(right[12:])  # once the first epoch's end was seen, every call
    assert Predictor.history([header("all_reduce", 7, 1)]) == Predictor.history(
        [header("all_reduce", 8, 2)]
    )
    assert Predictor.history([header("all_reduce", 7, 1)]) != Predictor.history(
        [header("has_data", 7, 1)]
    )


def test_a_run_longer_than_any_before_is_predicted_from_what_followed_its_collective() -> None:
    # Contexts never seen fall back to what followed the last collective (first order),
    # so a loop of one all-reduce is predicted from its third call on, however long.
    layout = ((torch.float32, 6),)
    p = Predictor()
    p.learn([_header(1)] * 2, None)
    right = _replay(p, [(2, layout)], 10)
    assert right == [False, False] + [True] * 8


def test_guesses_and_misses_are_counted() -> None:
    p = Predictor()
    p.counted(((torch.float32, 6),), ((torch.float32, 6),))
    p.counted(((torch.float32, 6),), None)
    assert (p.guesses, p.misses) == (2, 1)


def test_zeros_have_room_and_are_zero_again() -> None:
    p = Predictor()
    layout = ((torch.float32, 5), (torch.int64, 3))
    first = p.zeros(layout)
    assert [t.numel() for t in first] == [5 + INLINE_SLOTS, 3]
    first[0].fill_(3)
    again = p.zeros(layout)
    assert again[0] is first[0]
    assert not again[0].any()


def test_room_pool_recognises_its_buffers() -> None:
    rooms = RoomPool()
    view = rooms.take(np.dtype(np.float32), 10)
    room = rooms.room_of(torch.from_numpy(view))
    assert room is not None
    assert room.numel() == 10 + INLINE_SLOTS
    assert room.data_ptr() == view.ctypes.data
    assert rooms.room_of(torch.zeros(10)) is None
    assert rooms.room_of(torch.from_numpy(view[1:])) is None


def test_large_first_buffers_send_their_header_apart_and_first() -> None:
    from crossdevice._comm.workers.speculation import header_apart
    from crossdevice._core.tuning import TUNING

    APART_MIN_BYTES = TUNING.header_apart_min_bytes

    small = ((torch.float32, 1024),)
    large = ((torch.float32, APART_MIN_BYTES // 4),)
    assert not header_apart(small)
    assert header_apart(large)
    header = _header(3)
    data = torch.ones(1024 + INLINE_SLOTS)
    ops, slots, mine = speculative_ops(small, [data], header)
    assert len(ops) == 1
    assert ops[0][0].data_ptr() == data.data_ptr()
    assert ops[0][0].numel() == data.numel()  # the header rides in the last op
    assert ops[0][1] == (0, 0, 1024)
    assert slots.data_ptr() == data[-INLINE_SLOTS:].data_ptr()
    assert slots.tolist() == mine
    big = torch.ones(APART_MIN_BYTES // 4)
    ops, slots, mine = speculative_ops(large, [big], header)
    assert ops[0] == (slots, None)  # the header's own op goes first
    assert ops[1][0].data_ptr() == big.data_ptr()
    assert slots.dtype == torch.float64
    assert Predictor().zeros(large)[0].numel() == APART_MIN_BYTES // 4


def test_very_large_buffers_leave_in_chunks_covering_every_element() -> None:
    from crossdevice._comm.workers.speculation import Filler
    from crossdevice._core.tuning import TUNING

    CHUNK_BYTES, PIPELINE_MIN_BYTES = TUNING.chunk_bytes, TUNING.pipeline_min_bytes

    numel = PIPELINE_MIN_BYTES // 4 + 1000
    layout = ((torch.float32, numel), (torch.float32, 10))
    buffers = [torch.zeros(numel), torch.zeros(10)]
    ops, _, _ = speculative_ops(layout, buffers, _header(4))
    spans = [span for _, span in ops if span is not None]
    assert spans[0] == (0, 0, CHUNK_BYTES // 4)
    assert spans[-1] == (1, 0, 10)
    covered = sum(stop - start for index, start, stop in spans if index == 0)
    assert covered == numel
    filled: list[tuple[int, int, int]] = []
    filler = Filler(lambda *span: filled.append(span), [numel, 0, 10])
    filler.live(1, 2, 5)  # the second non-empty buffer is buffer 2
    filler.all()
    filler.all()  # once only
    filler.live(0, 0, 1)  # after all: nothing more
    assert filled == [(2, 2, 5), (0, 0, numel), (2, 0, 10)]


def test_lazy_packs_fill_the_pack_or_a_slot_with_the_same_bytes() -> None:
    from crossdevice._comm.workers.packs import LazyPacks

    rooms = RoomPool()
    host = [torch.arange(5, dtype=torch.float32), torch.arange(3, dtype=torch.float32) + 10]
    odd = [torch.ones(4, dtype=torch.bfloat16)]  # no NumPy dtype: packed at once
    packs = LazyPacks(rooms, [host, odd])
    assert rooms.room_of(packs.flats[0]) is not None
    assert packs.flats[1].tolist() == [1.0] * 4
    whole = torch.cat(host)
    for start, stop in [(0, 8), (2, 7), (4, 6), (5, 8)]:
        out = np.full(stop - start, -1.0, np.float32)
        packs.fill(0, start, stop, out=out)
        assert out.tolist() == whole[start:stop].tolist()
    packs.fill(0, 3, 8)  # into the pack itself, by ranges
    packs.fill(0, 0, 3)
    assert packs.flats[0].tolist() == whole.tolist()
    out16 = torch.zeros(2, dtype=torch.int16).numpy()  # bfloat16 bits, as a view
    packs.fill(1, 1, 3, out=out16)
    assert out16.tolist() == packs.flats[1][1:3].view(torch.int16).tolist()


def test_chunks_follow_the_tuning_in_force_for_a_layout_seen_before() -> None:
    # The split is remembered per layout: a changed tuning must split it afresh, and the
    # old split must come back with the old tuning (every worker splits alike).
    from crossdevice._core import tuning

    numel = 4096
    layout = ((torch.float32, numel),)
    buffers = [torch.zeros(numel + INLINE_SLOTS)]
    whole, _, _ = speculative_ops(layout, buffers, _header(5))
    assert [span for _, span in whole] == [(0, 0, numel)]
    assert whole[0][0] is buffers[0]  # one op: the whole buffer, header room and all
    with tuning.overridden(pipeline_min_bytes=1024, chunk_bytes=4096):
        ops, _, _ = speculative_ops(layout, buffers, _header(5))
        assert [span for _, span in ops] == [(0, k, k + 1024) for k in range(0, numel, 1024)]
        assert ops[-1][0].numel() == 1024 + INLINE_SLOTS  # the last chunk takes the room
    with tuning.overridden(header_apart_min_bytes=1024):
        ops, slots, _ = speculative_ops(layout, buffers, _header(5))
        assert ops[0] == (slots, None)  # the header apart, as the new tuning says
    again, _, _ = speculative_ops(layout, buffers, _header(5))
    assert [span for _, span in again] == [(0, 0, numel)]


def test_a_split_worked_out_while_the_tuning_changed_is_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Another thread changes the tuning (and splits a layout under it) while this one
    # works out a split under the old tuning: that split must not be kept as the new one's.
    import contextlib

    from crossdevice._comm.workers import speculation
    from crossdevice._core import tuning

    numel = 4100  # a layout of this test's own
    layout = ((torch.float32, numel),)
    buffers = [torch.zeros(numel + INLINE_SLOTS)]
    original = speculation.header_apart
    changed = contextlib.ExitStack()

    def meanwhile(layout_: Any, cut: Any = None) -> bool:
        if layout_ == layout:  # the other thread, now: a new tuning and a split under it
            changed.enter_context(tuning.overridden(pipeline_min_bytes=1024, chunk_bytes=4096))
            other = ((torch.float32, 8),)
            speculative_ops(other, [torch.zeros(8 + INLINE_SLOTS)], _header(5))
        return original(layout_, cut)

    speculative_ops(((torch.float32, 16),), [torch.zeros(16 + INLINE_SLOTS)], _header(5))
    monkeypatch.setattr(speculation, "header_apart", meanwhile)
    with changed:
        whole, _, _ = speculative_ops(layout, buffers, _header(5))
        assert [span for _, span in whole] == [(0, 0, numel)]  # the old tuning's split
        monkeypatch.setattr(speculation, "header_apart", original)
        ops, _, _ = speculative_ops(layout, buffers, _header(5))
        assert len(ops) == 5  # the new tuning's: 4 chunks of 1024 elements and the rest
