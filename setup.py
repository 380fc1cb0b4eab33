"""The one thing pyproject.toml cannot say: the optional compiled kernel.

`crossdevice._arrays._hostsum` (a fused in-order n-ary sum with streaming stores, see
src/crossdevice/_arrays/native.py) is built when a C compiler is present. `optional=True`
lets the install go on without it; crossdevice then uses its NumPy kernels.
"""

import os

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "crossdevice._arrays._hostsum",
            sources=["src/crossdevice/_arrays/_hostsum.c"],
            # Element order is the whole point: never let the compiler reassociate adds.
            extra_compile_args=[] if os.name == "nt" else ["-fno-fast-math"],
            optional=True,
        )
    ]
)
