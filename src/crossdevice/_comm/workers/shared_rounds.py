"""The communicator's shared-memory side: set-up, and all-reduce rounds through `/dev/shm`.

`SharedRounds` is a part of `pg_base.CommunicatorBase`: it connects the workers' slots
(`shared_memory.SharedSlots`) when the communicator is built and runs a predicted
all-reduce through them (`_inline_shared`) instead of Gloo when every worker shares
this host. See `shared_memory.py` for the protocol.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from crossdevice._comm.workers.calls import (
    MIN_WAIT_SECONDS,
    POLL_SECONDS,
    Call,
    PeersFailedError,
)
from crossdevice._comm.workers.health import HealthBoard, PeerFailure
from crossdevice._comm.workers.shared_memory import SharedSlots, plan_rounds, uses_shared_memory
from crossdevice._comm.workers.speculation import Layout, RoomPool

__all__ = ["SharedRounds"]


class SharedRounds:
    """All-reduces through shared memory for a communicator whose workers share a host.

    The communicator sets `_rank`, `_world_size`, `_seq`, `_host_group`, `_health`,
    `_rooms` and `timeout`, and provides `_run` and `_fail` (`pg_base`).
    """

    _rank: int
    _world_size: int
    _seq: int
    _host_group: Any
    _health: HealthBoard
    _rooms: RoomPool
    _shared: SharedSlots | None = None

    _broken: str | None
    timeout: Any
    _run: Callable[..., None]
    _fail: Callable[[Call, Exception], None]
    abort: Callable[[BaseException], None]

    def _connect_shared(self) -> None:
        """Map every worker's slots when they all share this host (else stay on Gloo)."""
        self._shared = SharedSlots.connect(self._rank, self._world_size, self._exchange)

    def _close_shared(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None

    def _gather_small(self, call: Call, mine: torch.Tensor) -> np.ndarray:
        """Every worker's small host tensor `mine`, in rank order, waited on as `call`."""
        outs = [torch.empty_like(mine) for _ in range(self._world_size)]
        self._run(
            call, lambda: [dist.all_gather(outs, mine, group=self._host_group, async_op=True)]
        )
        return torch.stack(outs).numpy()

    def _exchange(self, mine: torch.Tensor) -> np.ndarray:
        """All-gather a small host tensor at set-up (watched as any collective, unnumbered)."""
        call = Call("set-up exchange", self._seq, float(self.timeout), time.monotonic())
        return self._gather_small(call, mine)

    def _shares(self, layout: Layout) -> bool:
        """Whether an all-reduce of `layout` goes through shared memory (same host)."""
        shared = self._shared
        return shared is not None and uses_shared_memory(layout, shared.min_bytes)

    def _inline_shared(
        self,
        call: Call,
        header_np: np.ndarray,
        predicted: Layout,
        sources: list[torch.Tensor] | None,
        overlap: Callable[[], None] | None,
        fill: Callable[..., bool] | None,
    ) -> tuple[bool, bool]:
        """`_inline` through shared memory (`shared_memory.py`): (this call fit, all agree).

        Round 0's data and this worker's header are in its slots before it arrives;
        once every worker has arrived and every header equals this one, each worker sums
        the slots into `call.outputs`, and the later rounds follow, one barrier each.
        Every worker takes the same branches: they depend on the layout and on the
        headers alone. `fill` (see `speculation.Filler.live`) writes this worker's data
        straight into its slots.
        """
        shared = self._shared
        assert shared is not None
        rounds = plan_rounds(predicted)
        try:
            number, parity = shared.next_round()
            if sources is not None:
                shared.write(parity, rounds[0], sources, fill)
            shared.arrive(number, parity, header_np)
            if sources is None and overlap is not None:
                overlap()  # the copy the Gloo all-reduce after the check will need
            self._wait_round(call, number)
            agrees = shared.headers_equal(parity, header_np)
            if sources is None or not agrees:
                return sources is not None, agrees
            outputs = [self._rooms.buffer(t.dtype, t.numel())[: t.numel()] for t in sources]
            shared.reduce(parity, rounds[0], outputs)
            for spec in rounds[1:]:
                number, parity = shared.next_round()
                shared.write(parity, spec, sources, fill)
                shared.arrive(number, parity)
                self._wait_round(call, number)
                shared.reduce(parity, spec, outputs)
        except BaseException as err:
            # Leaving the rounds midway (a failed fill, an interrupt, a failed wait): the
            # peers must not go on with this worker's slots. Mark it gone, refuse further
            # collectives, and tell the peers why (the store), before re-raising.
            if self._broken is None:
                self.abort(err)  # `_fail` did not name the failure: tell the peers why
            shared.poison()
            raise
        call.outputs = outputs
        return True, True

    def _wait_round(self, call: Call, number: int) -> None:
        """Wait until every worker arrived at shared round `number`, watching their health."""
        shared = self._shared
        assert shared is not None
        try:
            next_check = time.monotonic() + POLL_SECONDS
            while behind := shared.waiting_for(number):
                gone = shared.poisoned()
                if gone:
                    # Its abort reason is in the store (posted before the mark), if any.
                    failures = self._health.check() or [
                        PeerFailure(r, "left a shared-memory all-reduce midway", False)
                        for r in gone
                    ]
                    raise PeersFailedError(failures)
                now = time.monotonic()
                remaining = call.remaining()
                if remaining < MIN_WAIT_SECONDS:
                    raise TimeoutError(f"no reply within {call.timeout:g} s")
                if now >= next_check:  # however often the waits return early
                    next_check = now + POLL_SECONDS
                    failures = self._health.check()
                    if failures:
                        raise PeersFailedError(failures)
                shared.wait(number, behind[0], min(next_check - now, remaining))
        except Exception as err:
            self._fail(call, err)
