"""Where a warning points: the user's line, the first frame outside crossdevice and torch.

A warning raised deep in the library (a run's end, a checkpoint's save, the end of a
pass over the data) named a file of the library with a fixed `stacklevel`, and a frame
added on the way moved it (`agreement._warn_lengths` pointed at the iterator once its
check gained a wrapper). `user_stacklevel` counts the frames instead.
"""

from __future__ import annotations

import os
import sys
from typing import Final

__all__ = ["user_stacklevel"]

#: This package's folder: its frames are not the user's.
_PACKAGE: Final = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_stacklevel() -> int:
    """`warnings.warn`'s `stacklevel`, for the function calling this, naming the user's line.

    The first frame above that function outside crossdevice and torch (torch's when a
    hook or a compiled step runs the library), or the outermost frame.
    """
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    libraries: tuple[str, ...] = (_PACKAGE,)
    if isinstance(torch_file, str):
        libraries += (os.path.dirname(os.path.abspath(torch_file)),)
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(libraries):
        frame, level = frame.f_back, level + 1
    return level
