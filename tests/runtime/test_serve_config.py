"""`runtime serve --config FILE` (runtime/serve_config.py, runtime/cli.py): the file's options reach
the engine, command-line flags override them, the data-parallel children get the resolved
values, `runtime tune`'s writer round-trips through serve's reader, and every bad file is one
line with exit code 2."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from slimserve.runtime import cli
from slimserve.runtime.engine.async_engine import AsyncEngine
from slimserve.runtime.serve_config import (
    ServeConfigError,
    check_serve_config,
    load_serve_config,
    read_serve_config,
    write_serve_config,
)
from slimserve.runtime.serve_options import file_options, replica_argv
from slimserve.runtime.tune.runner import serve_options
from slimserve.runtime.tune.search import Setting

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo-model"


@pytest.fixture
def engine_config(monkeypatch):
    """Run `runtime serve ...` up to the engine and return the EngineConfig it would start."""
    seen = {}

    def from_config(config, **kw):
        seen["config"] = config
        raise ValueError("captured the engine config")

    monkeypatch.setattr(AsyncEngine, "from_config", staticmethod(from_config))

    def run(*args: str):
        seen.clear()
        r = CliRunner().invoke(cli.app, ["serve", *args])
        assert r.exit_code == 2 and "captured the engine config" in r.output, r.output
        return seen["config"]

    return run


def invoke(*args: str):
    return CliRunner().invoke(cli.app, ["serve", *args])


def one_line_error(r, *needles: str) -> None:
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output, r.output
    for needle in needles:
        assert needle in r.output, r.output


def test_file_sets_options_and_flags_override_it(engine_config, tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        f"model: {DEMO}\nmax-num-seqs: 12\nmax_num_batched_tokens: 384\n"
        "--block-size: 32\nenable_prefix_caching: false\nkv_cache_memory: 64MiB\n"
        "device: cpu\ndtype: float32\nserved_model_name: from-file\n"
        "max_model_len: null\n"
    )
    c = engine_config("--config", str(cfg))
    assert (
        c.model,
        c.max_num_seqs,
        c.max_num_batched_tokens,
        c.block_size,
        c.enable_prefix_caching,
        c.kv_cache_memory,
        c.device,
        c.dtype,
        c.served_model_name,
        c.max_model_len,
    ) == (str(DEMO), 12, 384, 32, False, 64 * 2**20, "cpu", "float32", "from-file", None)
    # flags on the command line win, in any position; the rest still comes from the file
    c = engine_config(
        "--max-num-seqs",
        "5",
        "--config",
        str(cfg),
        "--enable-prefix-caching",
        "--served-model-name",
        "cli",
    )
    assert (
        c.max_num_seqs,
        c.enable_prefix_caching,
        c.served_model_name,
        c.max_num_batched_tokens,
        c.block_size,
    ) == (5, True, "cli", 384, 32)
    # MODEL on the command line overrides the file's
    other = tmp_path / "other-model"
    other.mkdir()
    assert engine_config(str(other), "--config", str(cfg)).model == str(other)
    # without --config nothing changes: serve's own defaults
    c = engine_config(str(DEMO))
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.enable_prefix_caching) == (256, 2048, True)


def test_relative_model_is_resolved_against_the_file(engine_config, tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m").mkdir()
    cfg = tmp_path / "conf" / "s.yaml"
    cfg.parent.mkdir()
    cfg.write_text("artifact: ../models/m\nmax_num_seqs: 3\n")
    assert engine_config("--config", str(cfg)).model == str((tmp_path / "models" / "m").resolve())


def test_data_parallel_children_get_the_file_values(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(cli, "_serve_data_parallel", lambda o: seen.update(o=o))
    cfg = tmp_path / "dp.yaml"
    cfg.write_text(
        f"model: {DEMO}\ndata_parallel_size: 2\nmax_num_seqs: 24\nport: 8123\n"
        "enable_prefix_caching: false\n"
    )
    r = invoke("--config", str(cfg), "--max-num-batched-tokens", "768")
    assert r.exit_code == 0, r.output
    o = seen["o"]
    flags = replica_argv(o)  # what each child gets on its command line
    assert (o.artifact, o.data_parallel_size, o.port) == (str(DEMO), 2, 8123)
    assert flags[flags.index("--max-num-seqs") + 1] == "24"
    assert flags[flags.index("--max-num-batched-tokens") + 1] == "768"
    assert "--no-enable-prefix-caching" in flags and "--config" not in flags


@pytest.mark.parametrize(
    "body, needles",
    [
        ("max_num_seq: 8\n", ["unknown key 'max_num_seq'", "did you mean max_num_seqs?"]),
        ("config: other.yaml\n", ["unknown key 'config'"]),
        ("max_num_seqs: eight\n", ["max_num_seqs must be an integer", "'eight'"]),
        ("max_num_seqs: 8.5\n", ["max_num_seqs must be an integer"]),
        ("max_num_seqs: true\n", ["max_num_seqs must be an integer"]),
        ("enable_prefix_caching: 1\n", ["enable_prefix_caching must be true or false"]),
        ("port: 70000\n", ["port 70000 must be <= 65535"]),
        ("body_timeout: 0\n", ["body_timeout 0.0 must be >= 0.1"]),
        ("device: [cpu]\n", ["device must be a string"]),
        ("max_num_seqs: 8\nmax-num-seqs: 9\n", ["repeats another spelling of 'max_num_seqs'"]),
        ("max_num_seqs: [8\n", ["not valid YAML", "line 2"]),
        ("- max_num_seqs\n", ["holds a list, not a mapping"]),
        ("7: 8\n", ["key 7 is not an option name"]),
    ],
)
def test_bad_files_are_one_line(tmp_path, body, needles):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(body)
    one_line_error(invoke(str(DEMO), "--config", str(cfg)), f"--config {cfg}", *needles)


def test_missing_or_unreadable_file_is_one_line(tmp_path):
    one_line_error(
        invoke(str(DEMO), "--config", str(tmp_path / "none.yaml")), "none.yaml", "cannot read it"
    )
    one_line_error(invoke(str(DEMO), "--config", str(tmp_path)), "cannot read it")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00model")
    one_line_error(invoke(str(DEMO), "--config", str(tmp_path / "bin.yaml")), "cannot read it")


def test_empty_file_changes_nothing_and_model_is_still_required(engine_config, tmp_path):
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("# nothing yet\n")
    assert engine_config(str(DEMO), "--config", str(cfg)).max_num_seqs == 256
    r = invoke("--config", str(cfg))
    assert r.exit_code == 2 and "Missing" in r.output and "Traceback" not in r.output


def test_tune_writer_round_trips_through_serve_reader(tmp_path):
    setting = Setting(32, 512, "fp8_e4m3", False)
    base = {
        "device": "cpu",
        "kv_cache_memory": "256MiB",
        "verify": "none",
        "allow_failed_gate": True,
    }
    path = write_serve_config(
        tmp_path / "serve.yaml",
        serve_options(str(DEMO), base, setting),
        comment="written by a test\nsecond line",
        options=file_options(),
    )
    text = path.read_text()
    assert text.startswith("# written by a test\n# second line\nmodel: ")
    loaded = load_serve_config(path, file_options())
    assert loaded == {"artifact": str(DEMO), **base, **setting.flags()}
    # every key tune writes is one of serve's options with the type serve declares
    opts = file_options()
    for key, value in setting.flags().items():
        assert isinstance(value, opts[key].kind)
    assert read_serve_config(path)["model"] == str(DEMO)


def test_file_options_give_types_and_ranges():
    opts = file_options()
    assert opts["artifact"].argument and opts["artifact"].kind is str
    assert (opts["port"].kind, opts["port"].low, opts["port"].high) == (int, 0, 65535)
    assert opts["max_model_len"].kind is int  # Optional[int]
    assert opts["enable_prefix_caching"].kind is bool and opts["body_timeout"].kind is float
    assert "config" not in opts and "help" not in opts
    with pytest.raises(ServeConfigError, match="unknown key 'nope'"):
        check_serve_config({"nope": 1}, opts, "f.yaml")
