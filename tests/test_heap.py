"""`keep_heap`: memory a step frees stays in the heap for the next step (glibc).

Each check runs in a fresh interpreter (malloc's thresholds are process-wide and cannot
be put back) and counts the page faults of a training step's pattern: blocks of 10 MiB
allocated, written and freed, five times over after three to settle. glibc's defaults
hand the freed top of the heap back every time (its moving trim threshold is twice the
largest block freed), so every repeat faults its 30 MiB in again: about 25k faults. With
the thresholds kept, none.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from crossdevice._arrays import heap

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds (Linux with glibc)"
)


def _huge_pages_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            return "[always]" in f.read()
    except OSError:
        return False


#: With transparent huge pages always on, fresh heap pages fault in 2 MiB at a time, so
#: the defaults' cost no longer shows as thousands of faults.
small_pages = pytest.mark.skipif(_huge_pages_always(), reason="huge pages: few faults anyway")

#: Prints `kept <bool>` (after SETUP) and `faults <n>`: the page faults of 5 step-like cycles.
_PROBE = textwrap.dedent(
    """
    import ctypes, resource
    SETUP
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.restype = ctypes.c_void_p
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    from crossdevice._arrays import heap
    print("kept", heap.kept())

    def step():
        blocks = [libc.malloc(10 << 20) for _ in range(3)]
        for block in blocks:
            libc.memset(block, 1, 10 << 20)
        for block in reversed(blocks):
            libc.free(block)

    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    print("faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _probe(
    setup: str, keep: str | None = None, extra: dict[str, str] | None = None
) -> tuple[bool, int]:
    env = dict(os.environ)
    env.pop(heap.ENV, None)
    if keep is not None:
        env[heap.ENV] = keep
    env.update(extra or {})
    code = _PROBE.replace("SETUP", setup)
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = dict(line.split() for line in done.stdout.splitlines())
    return lines["kept"] == "True", int(lines["faults"])


@small_pages
def test_glibc_defaults_fault_a_steps_blocks_in_again() -> None:
    # The probe's baseline: without keep_heap every repeat of the step takes fresh pages
    # (25k faults here, of 38k pages: so the check below can fail).
    kept, faults = _probe("")
    assert not kept
    assert faults > 10_000


def test_kept_heap_serves_the_next_step_from_the_pages_the_last_one_freed() -> None:
    kept, faults = _probe("from crossdevice._arrays import heap; assert heap.keep_heap()")
    assert kept
    assert faults < 500


@small_pages
def test_environment_zero_leaves_malloc_alone() -> None:
    kept, faults = _probe("from crossdevice._arrays import heap; heap.keep_heap()", keep="0")
    assert not kept
    assert faults > 10_000


@pytest.mark.parametrize(
    "variable",
    ["MALLOC_TRIM_THRESHOLD_=131072", "GLIBC_TUNABLES=glibc.malloc.trim_threshold=131072"],
)
def test_a_process_that_chose_mallocs_settings_keeps_them(variable: str) -> None:
    name, value = variable.split("=", 1)
    kept, _ = _probe("from crossdevice._arrays import heap; heap.keep_heap()", extra={name: value})
    assert not kept


def test_elsewhere_than_glibc_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_kept", None)
    monkeypatch.setattr(platform, "libc_ver", lambda *args, **kwargs: ("musl", "1.2"))
    assert heap.keep_heap() is False
    assert heap.kept() is False


def test_prepare_keeps_the_heap_of_a_training_process() -> None:
    pytest.importorskip("torch")
    setup = textwrap.dedent(
        """
        import torch, crossdevice, crossdevice.torch as cdt
        strategy = crossdevice.MirroredStrategy(["CPU:0"])
        with strategy.scope():
            model = torch.nn.Linear(2, 2)
            cdt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        """
    )
    kept, faults = _probe(setup)
    assert kept
    assert faults < 500
