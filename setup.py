"""Package discovery: the four layer folders at the repository root are installed as
slimserve.kernels, slimserve.runtime, slimserve.compress and slimserve.eval, with every
subpackage found by setuptools (no hand-kept list). Everything else lives in pyproject.toml."""

from setuptools import find_packages, setup

LAYERS = ("kernels", "runtime", "compress", "eval")

setup(
    package_dir={f"slimserve.{layer}": layer for layer in LAYERS},
    packages=[f"slimserve.{p}" for p in find_packages(include=[*LAYERS, *(f"{x}.*" for x in LAYERS)])],
    package_data={"slimserve.kernels": ["*.c"]},  # C sources compiled at first use (kernels/cpu_attention.py)
)
