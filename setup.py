"""Builds the `vllm_magicpig._C` extension (pybind11 + OpenMP).

The kernel chooses its AVX-512 path at run time, so the build itself must not
assume any ISA beyond the baseline x86-64 / aarch64 one: no -march=native.
"""
import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext = Pybind11Extension(
    "vllm_magicpig._C",
    sorted(glob.glob("cpp/*.cpp")),
    include_dirs=["cpp"],
    # build_ext does not scan #includes: listing the headers makes a header edit rebuild every file.
    depends=sorted(glob.glob("cpp/*.h")),
    cxx_std=17,
    extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno"],
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
