"""Export never deletes what is not its own; files get umask modes and are fsynced before the
rename; a failed-gate manifest is refused by the engine's loader unless allowed."""

import os
import stat

import pytest

from slimserve.compress import pipeline
from slimserve.compress.errors import RecipeError
from slimserve.compress.export import io as export_io
from slimserve.compress.export.io import export_compressed_tensors, failed_output, replace_problem
from slimserve.compress.recipe import parse_recipe
from slimserve.runtime.artifact.manifest import ArtifactManifest, check_gate
from slimserve.runtime.errors import ArtifactError
from tests.helpers.tiny_model import tiny_llama


def _export(out):
    return export_compressed_tensors(tiny_llama(), None, {}, out, ArtifactManifest(base_model="t"))


def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_replace_problem(tmp_path):
    assert replace_problem(tmp_path / "new") is None
    (tmp_path / "empty").mkdir()
    assert replace_problem(tmp_path / "empty") is None
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "slimserve.json").write_text("{}")
    assert replace_problem(tmp_path / "art") is None
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    assert "not a slimserve artifact" in replace_problem(tmp_path / "home")
    (tmp_path / "file").write_text("x")
    assert "not a folder" in replace_problem(tmp_path / "file")
    assert failed_output(tmp_path / "art") == tmp_path / "art.failed"


def test_export_refuses_non_artifact_folder_and_leaves_it(tmp_path):
    out = tmp_path / "models"
    (out / "other-model").mkdir(parents=True)
    (out / "other-model" / "weights.bin").write_bytes(b"precious")
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    with pytest.raises(ArtifactError, match="not a slimserve artifact"):
        _export(out)
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # no temporary folders left


def test_export_rechecks_before_the_move(tmp_path, monkeypatch):
    """A folder that appears while the export writes is not deleted either."""
    out = tmp_path / "art"
    real = export_io.write_manifest

    def write_then_squat(folder, manifest):
        out.mkdir()
        (out / "mine.txt").write_text("mine")
        return real(folder, manifest)

    monkeypatch.setattr(export_io, "write_manifest", write_then_squat)
    with pytest.raises(ArtifactError, match="not a slimserve artifact"):
        _export(out)
    assert (out / "mine.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_export_replaces_earlier_artifact_and_empty_folder(tmp_path):
    out = tmp_path / "art"
    out.mkdir()
    _export(out)  # an empty folder is replaced
    (out / "stale.txt").write_text("from the earlier run")
    _export(out)  # an earlier artifact (it has slimserve.json) is replaced
    assert not (out / "stale.txt").exists() and (out / "slimserve.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_export_modes_follow_umask(tmp_path):
    old = os.umask(0o022)
    try:
        out = _export(tmp_path / "art")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {
        p.name: 0o644 for p in files
    }
    old = os.umask(0o077)
    try:
        out = _export(tmp_path / "private")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o600


def test_export_fsyncs_every_file_before_the_rename(tmp_path, monkeypatch):
    synced, events = [], []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def replace(src, dst):
        events.append((str(src), str(dst), list(synced)))
        return real_replace(src, dst)

    monkeypatch.setattr(export_io.os, "fsync", fsync)
    monkeypatch.setattr(export_io.os, "replace", replace)
    out = _export(tmp_path / "art")
    src, dst, synced_before = events[-1]
    assert dst == str(out)
    names = {os.path.basename(p) for p in synced_before if os.path.dirname(p) == src}
    assert {"model.safetensors", "config.json", "slimserve.json"} <= names
    assert src in synced_before  # the folder itself
    assert str(tmp_path) in synced  # and its parent after the rename


def _recipe(tmp_path, model, output):
    text = (
        f"model: {model}\noutput: {output}\nstages:\n  - rtn: {{scheme: W4A16, group_size: 32}}\n"
    )
    return parse_recipe(text, tmp_path / "r.yaml")


@pytest.fixture
def model_dir(tmp_path):
    m = tmp_path / "base"
    m.mkdir()
    (m / "config.json").write_text("{}")
    (m / "model.safetensors").write_bytes(b"weights")
    return m


@pytest.mark.parametrize(
    "output,words",
    [
        (".", "is the model folder"),
        ("sub/art", "is inside the model folder"),
        ("..", "contains the model folder"),
    ],
)
def test_output_and_model_overlap_refused(tmp_path, model_dir, output, words):
    recipe = _recipe(tmp_path, model_dir, model_dir / output)
    with pytest.raises(RecipeError, match=words):
        pipeline.check_output(recipe)


@pytest.mark.parametrize("failed", [False, True])
def test_run_refuses_non_artifact_output_before_loading(tmp_path, model_dir, monkeypatch, failed):
    out = tmp_path / "models"
    squat = failed_output(out) if failed else out
    squat.mkdir()
    (squat / "notes.txt").write_text("mine")

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(pipeline, "load_model", no_load)
    with pytest.raises(RecipeError, match=f"output: {squat} is not empty"):
        pipeline.run_recipe(_recipe(tmp_path, model_dir, out), log=lambda m: None, progress=False)
    assert (squat / "notes.txt").read_text() == "mine"


def _manifest(passed):
    gate = {"max_ppl_increase": 0.01, "ppl_increase": 0.25, "passed": passed}
    return ArtifactManifest(base_model="t", eval={"gate": gate})


def test_check_gate():
    check_gate("art", None)
    check_gate("art", ArtifactManifest(base_model="t"))
    check_gate("art", _manifest(True))
    check_gate("art", _manifest(False), allow_failed_gate=True)
    with pytest.raises(ArtifactError) as e:
        check_gate("art", _manifest(False))
    msg = str(e.value)
    assert "art" in msg and "+25.00%" in msg and "1.00%" in msg and "--allow-failed-gate" in msg
    assert "\n" not in msg
