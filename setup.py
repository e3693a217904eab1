"""The C++ part of kiln: its own low-bit GEMM, an ONNX Runtime custom-op library (kiln/kernels/).

Everything else is in pyproject.toml. The library is optional: where no C++17 compiler is found, or the build fails,
kiln installs without it and runs ONNX Runtime's MatMulNBits on the same codes (`kiln check` says which).
It is loaded by ONNX Runtime (RegisterCustomOps), never imported by Python, and needs no ONNX Runtime headers.
"""

from setuptools import Extension, setup

KERNELS = Extension(
    "kiln.runtimes._kernels",
    sources=["kiln/kernels/gemm.cpp", "kiln/kernels/op.cpp"],
    depends=["kiln/kernels/gemm.h", "kiln/kernels/ort_api.h"],
    language="c++",
    # -ffp-contract=off: no multiply-add is fused unless written so (every path must round alike);
    # per-function target attributes select AVX2 / AVX-512 at run time, so the baseline stays plain x86-64
    extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off", "-fvisibility=hidden", "-fno-math-errno"],
    optional=True,
)

setup(ext_modules=[KERNELS])
