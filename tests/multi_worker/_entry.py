"""Child side of the harness: `python -m tests.multi_worker._entry PAYLOAD RESULT`."""

from __future__ import annotations

import faulthandler
import importlib
import os
import pickle
import sys
import traceback
from typing import Any


def main(payload_path: str, result_path: str) -> None:
    with open(payload_path, "rb") as f:
        module_name, qualname, rank, world_size, args, timeout = pickle.load(f)
    # A worker stuck past the harness deadline dumps its stacks, then exits.
    faulthandler.dump_traceback_later(timeout, exit=True)
    fn: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    try:
        outcome = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException as err:  # report everything, including SystemExit
        outcome = {
            "ok": False,
            "type": type(err).__name__,
            "message": str(err),
            "traceback": traceback.format_exc(),
        }
    tmp = f"{result_path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(outcome, f)
    os.replace(tmp, result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: torch.distributed's atexit work can block on dead peers.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
