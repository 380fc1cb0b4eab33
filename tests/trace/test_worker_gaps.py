"""The workers' gap exchange (`WorkerGaps`) over a store whose `set` gets no reply."""

from __future__ import annotations

from crossdevice._trace.stragglers import WorkerGaps


class _Server:
    """A c10d store's server: what its clients' calls have applied so far."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}


class _Client:
    """A TCPStore connection: `set` and `delete_key` are sent and not answered, so the
    server applies them no later than this client's next call that gets a reply; here,
    exactly then (the latest a real server may apply them)."""

    def __init__(self, server: _Server) -> None:
        self._server = server
        self._sent: list[tuple[str, str | None]] = []

    def set(self, key: str, value: str) -> None:
        self._sent.append((key, value))

    def delete_key(self, key: str) -> None:
        self._sent.append((key, None))

    def _replied(self) -> dict[str, str]:
        for key, value in self._sent:
            if value is None:
                self._server.data.pop(key, None)
            else:
                self._server.data[key] = value
        self._sent.clear()
        return self._server.data

    def check(self, keys: list[str]) -> bool:
        data = self._replied()
        return all(k in data for k in keys)

    def get(self, key: str) -> bytes:
        return self._replied()[key].encode()


def _gaps(rank: int, server: _Server, gap: float) -> WorkerGaps:
    gaps = WorkerGaps(rank, 2, _Client(server))
    for seq in range(1, 11):  # 10 collectives, each `gap` after the one before ended
        gaps.ended(0.0)
        gaps.issued(seq, gap)
    return gaps


def test_a_peer_reads_the_first_window_published_before_the_collectives_since() -> None:
    server = _Server()
    fast, slow = _gaps(0, server, 0.001), _gaps(1, server, 0.020)
    assert fast.window(1, "in steps 1-10") is None  # nothing before the first window
    assert slow.window(1, "in steps 1-10") is None
    # (the workers' collectives of window 2 run here: both published window 1 before)
    line = fast.window(2, "in steps 1-10")
    assert line is not None
    assert "worker 1 (workers) arrived last at 10 of 10" in line
