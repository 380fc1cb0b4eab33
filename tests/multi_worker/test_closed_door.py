"""A closed door: no wildcard listeners, hostile cluster descriptions rejected clearly."""

from __future__ import annotations

import json
from typing import Any

import pytest

from crossdevice._core.cluster import parse_tf_config, parse_torchrun_env
from tests.multi_worker.fault_workers import listening_sockets
from tests.multi_worker.harness import run_workers

_WILDCARDS = ("00000000", "00000000000000000000000000000000")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "tf_config"])
def test_no_socket_listens_on_a_wildcard_address(launcher: Any) -> None:
    outs = [r.unwrap() for r in run_workers(listening_sockets, 2, launcher=launcher, timeout=60)]
    assert outs[0]["listening"], "rank 0 serves the store: it must listen somewhere"
    for out in outs:
        assert out["total"] == 2.0
        for entry in out["listening"]:
            address = entry.split(":")[0]
            assert address not in _WILDCARDS, f"listening on every interface: {entry}"
            # 127.0.0.1 (0100007F) or ::ffff:127.0.0.1, as MASTER_ADDR says
            assert address.endswith("0100007F"), entry


def _tf_config(host: str = "127.0.0.1:2222", index: Any = 0, **task: Any) -> str:
    return json.dumps(
        {
            "cluster": {"worker": [host, "127.0.0.1:2223"]},
            "task": {"type": "worker", "index": index, **task},
        }
    )


HOSTILE_TF_CONFIGS = {
    "deep nesting": '{"cluster": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "too long": json.dumps({"cluster": {}, "pad": "x" * (2 << 20)}),
    "index True": _tf_config(index=True),
    "index 1.9": _tf_config(index=1.9),
    "index -1": _tf_config(index=-1),
    "index unicode digits": _tf_config(index="\u0661"),
    "host newline": _tf_config("evil\n.host:2222"),
    "host NUL": _tf_config("evil\x00host:2222"),
    "host space": _tf_config("evil host:2222"),
    "host slash": _tf_config("evil/x:2222"),
    "host user@": _tf_config("user@evil:2222"),
    "host scheme": _tf_config("tcp://evil:2222"),
    "port sign": _tf_config("127.0.0.1:+222"),
    "port huge": _tf_config("127.0.0.1:99999999999999999999"),
    "task type not str": _tf_config(type=["worker"]),
    "job key index": json.dumps(
        {"cluster": {"worker": {"1.5": "127.0.0.1:1"}}, "task": {"type": "worker", "index": 0}}
    ),
}


@pytest.mark.parametrize("config", list(HOSTILE_TF_CONFIGS.values()), ids=list(HOSTILE_TF_CONFIGS))
def test_hostile_tf_config_is_rejected_clearly(config: str) -> None:
    with pytest.raises(ValueError, match=r"expected|must be") as info:
        parse_tf_config(config)
    message = str(info.value)
    assert len(message) < 600  # a hostile value is quoted, not echoed whole


_ENV = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
HOSTILE_ENV = {
    "MASTER_ADDR scheme": {"MASTER_ADDR": "tcp://evil"},
    "MASTER_ADDR user": {"MASTER_ADDR": "root@evil"},
    "MASTER_ADDR newline": {"MASTER_ADDR": "evil\nhost"},
    "MASTER_ADDR NUL": {"MASTER_ADDR": "evil\x00"},
    "MASTER_ADDR space": {"MASTER_ADDR": "evil host"},
    "MASTER_ADDR path": {"MASTER_ADDR": "evil/path"},
    "RANK float": {"RANK": "1.0"},
    "RANK sign": {"RANK": "+1"},
    "RANK underscore": {"RANK": "0_1"},
    "RANK padded": {"RANK": " 1"},
    "RANK unicode": {"RANK": "\u0661"},
    "RANK out of range": {"RANK": "2"},
    "WORLD_SIZE zero": {"WORLD_SIZE": "0"},
    "MASTER_PORT zero": {"MASTER_PORT": "0"},
    "MASTER_PORT huge": {"MASTER_PORT": "70000"},
    "LOCAL_RANK negative": {"LOCAL_RANK": "-1"},
}


@pytest.mark.parametrize("change", list(HOSTILE_ENV.values()), ids=list(HOSTILE_ENV))
def test_hostile_torchrun_env_is_rejected_clearly(change: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="must be"):
        parse_torchrun_env({**_ENV, **change})


def test_good_values_still_parse() -> None:
    cluster = parse_torchrun_env({**_ENV, "MASTER_ADDR": "[::1]"})
    assert cluster is not None
    assert cluster.master_addr == "::1"
    parsed = parse_tf_config(_tf_config("node-1.example.com:2222", index="1"))
    assert parsed is not None
    assert parsed.rank == 1
