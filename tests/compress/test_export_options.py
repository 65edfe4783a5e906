"""What an export is given is defined once (`ExportOptions`, compress/export/io.py): every export
entry point takes one, or its fields as arguments, and no function of compress/export/ lists
those parameters again."""

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from slimserve.compress.export.formats import COMPRESSED_TENSORS, export_artifact
from slimserve.compress.export.io import ExportOptions, export_compressed_tensors
from slimserve.runtime.artifact.manifest import ArtifactManifest
from tests.helpers.tiny_model import tiny_llama

EXPORT = Path(__file__).resolve().parents[2] / "compress" / "export"
FIELDS = [f.name for f in dataclasses.fields(ExportOptions)]


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "slimserve.json").read_text())


def test_of_takes_an_export_options_or_its_fields():
    model, manifest = object(), ArtifactManifest(base_model="t")
    opts = ExportOptions(model, None, {}, Path("out"), manifest, kv_scales={"a": (1.0, 1.0)})
    assert ExportOptions.of(opts) is opts
    assert (
        ExportOptions.of(model, None, {}, Path("out"), manifest, kv_scales={"a": (1.0, 1.0)})
        == opts
    )
    assert ExportOptions.of(**{f: getattr(opts, f) for f in FIELDS}) == opts
    with pytest.raises(TypeError):
        ExportOptions.of(model, None, {}, Path("out"), manifest, kv_scale={})


@pytest.mark.parametrize("how", ["options", "positional", "keywords"])
@pytest.mark.parametrize("entry", ["export_artifact", "export_compressed_tensors"])
def test_each_entry_point_writes_the_same_artifact_from_each_form(tmp_path, entry, how):
    """One dense export per form; before_move (an optional field) is honoured in each."""
    moved = []
    opts = ExportOptions(
        tiny_llama(),
        None,
        {},
        tmp_path / "art",
        ArtifactManifest(base_model="t"),
        before_move=moved.append,
    )
    args = {
        "options": ((opts,), {}),
        "positional": (
            (opts.model, None, {}, opts.out_dir, opts.manifest),
            {"before_move": moved.append},
        ),
        "keywords": ((), {f: getattr(opts, f) for f in FIELDS}),
    }[how]
    if entry == "export_artifact":
        out = export_artifact(COMPRESSED_TENSORS, *args[0], **args[1])
    else:
        out = export_compressed_tensors(*args[0], **args[1])
    assert out == opts.out_dir and len(moved) == 1
    assert _manifest(out)["base_model"] == "t" and (out / "model.safetensors").is_file()


def test_no_export_function_lists_the_export_parameters_again():
    """A function of compress/export/ that needs the export's inputs takes ExportOptions; at most
    two of its fields (model, quantized: the tensors' own inputs) appear as parameters."""
    for path in sorted(EXPORT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
                again = names & set(FIELDS)
                assert len(again) <= 2, (
                    f"{path.name}:{node.lineno} {node.name} takes {sorted(again)}"
                )
