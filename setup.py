"""Package discovery: the four layer folders at the repository root are installed as
slimserve.kernels, slimserve.runtime, slimserve.compress and slimserve.eval, with every
subpackage found by setuptools (no hand-kept list). Everything else lives in pyproject.toml.

The layer folders themselves have no `__init__.py`: they are namespace portions, so a bare
`import kernels` (Hugging Face's package, which transformers imports) finds the installed
regular package even when the repository root is on sys.path (docs/architecture.md, "Layer
folders and sys.path"). Their subpackages are regular packages."""

from setuptools import find_namespace_packages, setup

LAYERS = ("kernels", "runtime", "compress", "eval")

setup(
    package_dir={f"slimserve.{layer}": layer for layer in LAYERS},
    packages=[
        f"slimserve.{p}"
        for p in find_namespace_packages(
            include=[*LAYERS, *(f"{x}.*" for x in LAYERS)], exclude=["*.__pycache__"]
        )
    ],
    package_data={
        "slimserve.kernels": ["*.c", "*.h"]
    },  # C sources (and their headers) compiled at first use (kernels/cpu_build.py)
)
