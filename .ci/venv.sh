# Shared by .ci/run, .ci/lock, .ci/newest and .ci/oldest (sourced, not run).

# fresh_venv DIR: a new virtualenv at DIR, activated, with the newest pip.
fresh_venv() {
    rm -rf "$1"
    python3 -m venv "$1"
    # shellcheck disable=SC1091
    source "$1/bin/activate"
    python -m pip install --quiet --upgrade pip
}

# show_versions: the versions that matter for a report line.
show_versions() {
    python - <<'PY'
from importlib.metadata import PackageNotFoundError, version
names = ["torch", "transformers", "kernels", "triton", "compressed-tensors", "accelerate",
         "tokenizers", "safetensors", "pydantic", "fastapi", "numpy", "datasets"]
def v(n):
    try:
        return version(n)
    except PackageNotFoundError:
        return "-"
print("versions: " + ", ".join(f"{n} {v(n)}" for n in names))
PY
}
