"""The README's tour runs and prints what the README says it prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[1] / "README.md"


def _tour_source() -> str:
    text = README.read_text()
    start = text.index("## A short tour")
    match = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert match is not None, "the README's tour has no python block"
    return match.group(1)


def test_readme_tour_runs_and_matches_its_comments() -> None:
    namespace: dict[str, object] = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(_tour_source(), str(README), "exec"), namespace)
    run = namespace["run"]
    strategy = namespace["strategy"]
    import crossdevice

    mirrored = run(crossdevice.MirroredStrategy(["CPU:0", "CPU:1"]))  # type: ignore[operator]
    assert [float(c.numpy()) for c in mirrored.values] == [2.0, 2.0]
    central = run(  # type: ignore[operator]
        crossdevice.experimental.CentralStorageStrategy(
            compute_devices=["CPU:0", "CPU:1"], parameter_device="CPU:0"
        )
    )
    assert float(central.numpy()) == 2.0
    assert float(run(crossdevice.OneDeviceStrategy("CPU:0")).numpy()) == 1.0  # type: ignore[operator]
    per_replica = namespace["per_replica"]
    np.testing.assert_array_equal(
        strategy.reduce("sum", per_replica, axis=None),
        [4.0, 6.0, 8.0, 10.0],  # type: ignore[attr-defined]
    )
    assert float(strategy.reduce("sum", per_replica, axis=0)) == 28.0  # type: ignore[attr-defined]
    assert float(strategy.reduce("mean", namespace["partial"], axis=0)) == 2.5  # type: ignore[attr-defined]
    result = strategy.run(namespace["fn"])  # type: ignore[attr-defined]
    for local in strategy.experimental_local_results(result):  # type: ignore[attr-defined]
        assert int(local["a"]) == 4
        assert [int(x) for x in local["b"]] == [42, 99]


def test_readme_torch_training_section_runs(torch_module: object) -> None:
    text = README.read_text()
    start = text.index("## Training a PyTorch model")
    match = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert match is not None, "the README's torch section has no python block"
    import crossdevice

    crossdevice.config.set_logical_cpu_devices(4)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(match.group(1), str(README), "exec"), {})
    assert float(out.getvalue()) > 0  # the printed step loss
