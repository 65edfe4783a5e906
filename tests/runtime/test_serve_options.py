"""One definition per option (runtime/serve_options.py): every field of `ServeOptions` and
`RouterOptions` reaches each place that uses it, as the table says, and nothing spells a serve
flag by hand elsewhere. Every check iterates over the tables, so a new field is covered by
adding it; a field that cannot be covered fails here (add its sample value to SAMPLES)."""

import ast
import dataclasses
import inspect
import sys
import typing
from contextlib import contextmanager
from pathlib import Path

import pytest
import typer
from typer.core import TyperArgument, TyperOption
from typer.testing import CliRunner

from slimserve.runtime import cli
from slimserve.runtime.config import EngineConfig
from slimserve.runtime.serve_config import OptionSpec, ServeConfigError, check_serve_config
from slimserve.runtime.serve_options import (
    ARGV,
    ENV,
    OWN,
    RouterOptions,
    ServeOptions,
    engine_kwargs,
    file_options,
    params,
    replica_argv,
    replica_env,
    router_options,
    serve_argv,
    tune_settings,
)
from slimserve.runtime.server import process
from slimserve.runtime.tune.search import SETTING_KEYS, Setting

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "demo-model"
SERVE = params(ServeOptions)
# values the serve command checks itself before it starts anything (the rest: `sample`)
SAMPLES = {
    "kv_segments_max_bytes": "4GiB",
    "kv_cache_memory": "64MiB",
    "role": "decode",
    "router_policy": "round-robin",
    "verify": "none",
    "dtype": "float32",
    "kv_cache_dtype": "fp8_e4m3",
    "device": "cpu",
}


def options_of(command) -> dict[str, OptionSpec]:
    """The file schema as a typer command's own signature declares it (what the command parses),
    to hold `file_options` to: every parameter but --config, its type and range."""
    hints = typing.get_type_hints(command)
    specs = {}
    for name, param in inspect.signature(command).parameters.items():
        if name == "config":
            continue
        kind = hints.get(name, str)
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = args[0] if typing.get_origin(kind) is not None and len(args) == 1 else kind
        info = param.default
        specs[name] = OptionSpec(
            name,
            kind if kind in (bool, int, float, str) else str,
            getattr(info, "min", None),
            getattr(info, "max", None),
            isinstance(info, typer.models.ArgumentInfo),
        )
    return specs


def click_command(name: str):
    return typer.main.get_command(cli.app).commands[name]


def sample(p, **given):
    """A value of option `p` other than its default that the command line accepts."""
    if p.name in given:
        return given[p.name]
    if p.name in SAMPLES:
        return SAMPLES[p.name]
    if p.kind is bool:
        return not p.default
    if p.kind in (int, float):
        low = p.how.min if p.how.min is not None else 0
        value = p.kind(max(p.default if p.default is not None else low, low) + 3)
        assert p.how.max is None or value <= p.how.max, f"give {p.name} a sample in SAMPLES"
        return value
    if p.kind is list:
        return [f"{p.name}-a", f"{p.name}-b"]
    return f"{p.name}-value"


def parse_serve(argv: list[str]) -> ServeOptions:
    """`runtime serve ARGV` parsed by the serve command itself (nothing started)."""
    ctx = click_command("serve").make_context("serve", list(argv))
    return ServeOptions(**ctx.params)


@pytest.fixture(autouse=True)
def no_key_env(monkeypatch):
    for p in SERVE:
        if p.how.envvar:
            monkeypatch.delenv(p.how.envvar, raising=False)


# -- the typer commands ------------------------------------------------------------------------


def _decls(p) -> set[str]:
    return {s.strip() for d in p.how.flags for s in d.split("/")}


@pytest.mark.parametrize("table, name", [(ServeOptions, "serve"), (RouterOptions, "router")])
def test_every_option_is_a_parameter_of_its_command_as_declared(table, name):
    cmd = click_command(name)
    ps = {c.name: c for c in cmd.params}
    assert list(ps) == [p.name for p in params(table)]  # the table's order is --help's
    for p in params(table):
        c = ps[p.name]
        assert c.help == p.how.help, p.name
        if p.default is ...:
            assert c.required, p.name
        else:
            assert c.default == p.default and not c.required, p.name
        if p.how.argument:
            assert isinstance(c, TyperArgument), p.name
            continue
        assert isinstance(c, TyperOption), p.name
        spelled = set(c.opts) | set(c.secondary_opts)
        assert spelled == (_decls(p) or spelled) and p.flag in c.opts, p.name
        assert c.envvar == p.how.envvar and c.is_eager == p.how.eager, p.name
        assert (c.min, c.max) == (p.how.min, p.how.max), p.name


def test_router_shares_serves_definitions():
    serve = {p.name: p for p in SERVE}
    shared = [p for p in params(RouterOptions) if p.how.shares]
    assert {p.how.shares for p in shared} >= {
        "host",
        "port",
        "api_key",
        "internal_key",
        "max_connections",
        "body_timeout",
        "stream_timeout",
        "router_policy",
    }
    for p in shared:
        src = serve[p.how.shares]
        assert (p.annotation, p.default, p.how.min, p.how.max, p.how.envvar) == (
            src.annotation,
            src.default,
            src.how.min,
            src.how.max,
            src.how.envvar,
        ), p.name
    # a data-parallel deployment's router gets serve's values of every shared option
    o = ServeOptions(**{q.name: sample(q) for q in SERVE})
    r = router_options(o, ["http://a", "http://b"])
    assert r.replica == ["http://a", "http://b"]
    for p in params(RouterOptions):
        want = getattr(o, p.how.shares) if p.how.shares else p.default
        if p.name != "replica":
            assert getattr(r, p.name) == want, p.name


def test_generate_takes_serves_definitions_of_the_options_it_shares():
    gen = {c.name: c for c in click_command("generate").params}
    serve = {c.name: c for c in click_command("serve").params}
    for name in (
        "trust_remote_code",
        "verify",
        "allow_failed_gate",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "distributed_executor_backend",
    ):
        g, s = gen[name], serve[name]
        assert (g.opts, g.secondary_opts, g.default, g.help) == (
            s.opts,
            s.secondary_opts,
            s.default,
            s.help,
        ), name


# -- the --config file --------------------------------------------------------------------------


def test_config_file_keys_are_the_file_options():
    schema = file_options()
    assert list(schema) == [p.name for p in SERVE if p.how.file]
    assert schema == options_of(cli.serve)  # the reader's schema is the command's own
    values = {p.name: sample(p) for p in SERVE if p.how.file}
    assert check_serve_config(values, schema, "f.yaml") == values
    for p in SERVE:
        if not p.how.file:
            with pytest.raises(ServeConfigError, match=f"unknown key '{p.name}'"):
                check_serve_config({p.name: sample(p)}, schema, "f.yaml")


def test_every_file_option_reaches_serve_from_a_file(monkeypatch, tmp_path):
    """A file giving every file option a non-default value: serve sees each of them."""
    seen = {}
    monkeypatch.setattr(cli, "_serve_data_parallel", lambda o: seen.update(o=o))
    given = {
        "artifact": str(DEMO),
        "data_parallel_size": 2,
        "prefill_replicas": 1,
        "role": "colocated",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "profile_dir": str(tmp_path / "prof"),
    }
    values = {p.name: sample(p, **given) for p in SERVE if p.how.file}
    cfg = tmp_path / "all.yaml"
    from slimserve.runtime.serve_config import write_serve_config

    write_serve_config(cfg, values, options=file_options())
    r = CliRunner().invoke(cli.app, ["serve", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    for name, value in values.items():
        assert getattr(seen["o"], name) == value, name


# -- the data-parallel replicas -----------------------------------------------------------------


def test_keys_reach_the_replicas_through_the_environment_never_argv():
    for p in SERVE:
        if p.how.envvar:
            assert p.how.replicas == ENV, p.name
        assert p.how.replicas in (ARGV, ENV, OWN), p.name
    o = ServeOptions(**{p.name: sample(p) for p in SERVE})
    argv = replica_argv(o)
    env = replica_env(o)
    for p in SERVE:
        if p.how.replicas == ENV:
            assert env[p.how.envvar] == str(getattr(o, p.name)), p.name
            assert str(getattr(o, p.name)) not in argv and p.flag not in argv, p.name
    assert set(env) == {p.how.envvar for p in SERVE if p.how.replicas == ENV}


def test_the_options_replicas_do_not_get_are_the_parents_own():
    """A new option goes to the replicas (ARGV, the default); keeping one from them (OWN) is a
    decision, listed here: the parent's own command line and the per-replica settings."""
    assert {p.name for p in SERVE if p.how.replicas == OWN} == {
        "artifact",
        "config",
        "host",
        "port",
        "device",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "distributed_executor_backend",
        "data_parallel_size",
        "router_policy",
        "role",
        "prefill_replicas",
    }


def test_replica_argv_round_trips_through_the_serve_command():
    """Every ARGV option with a non-default value comes back from the replica's command line as
    it was; nothing else is on it (the replica's OWN and ENV options keep serve's defaults)."""
    o = ServeOptions(**{p.name: sample(p) for p in SERVE})
    back = parse_serve([o.artifact, *replica_argv(o)])
    for p in SERVE:
        want = getattr(o, p.name) if p.how.replicas == ARGV or p.how.argument else p.default
        assert getattr(back, p.name) == want, p.name
    # and at serve's defaults too (flags that are off, options left unset)
    o = ServeOptions(artifact="m")
    assert parse_serve(["m", *replica_argv(o)]) == o


@pytest.fixture
def data_parallel(monkeypatch):
    """`runtime serve --data-parallel-size N` up to starting anything: `seen` gets the children's
    ServerSpecs ("specs") and the router's RouterOptions ("router")."""
    import signal

    seen = {}

    @contextmanager
    def launched(specs, timeout_s, die_with_parent=True):
        seen["specs"] = specs
        yield []

    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the SIGTERM handler stays pytest's
    monkeypatch.setattr(process, "launched_servers", launched)
    monkeypatch.setattr(cli, "_run_router", lambda r: seen.update(router=r))
    return seen


def key_env(name: str) -> str:
    return next(p.how.envvar for p in SERVE if p.name == name)


def test_data_parallel_children_and_router_get_every_option(data_parallel, tmp_path):
    """`runtime serve --data-parallel-size 2` with every option set: each child's command line
    parses back to the parent's ARGV options (plus its own host, port, device and role), the keys
    are in its environment only, and the router gets serve's shared options."""
    seen = data_parallel
    given = {
        "artifact": str(DEMO),
        "data_parallel_size": 2,
        "prefill_replicas": 1,
        "role": "colocated",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "config": None,
        "profile_dir": str((tmp_path / "prof").resolve()),
        "internal_key": "the-internal-key",
        "api_key": "the-api-key",
    }
    o = ServeOptions(**{p.name: sample(p, **given) for p in SERVE})
    argv = serve_argv({p.name: getattr(o, p.name) for p in SERVE})
    r = CliRunner().invoke(cli.app, ["serve", *argv])
    assert r.exit_code == 0, r.output
    specs = seen["specs"]
    assert len(specs) == 2
    for i, spec in enumerate(specs):
        assert spec.cmd[:4] == [sys.executable, "-m", process.SERVE_MODULE, "serve"]
        child = parse_serve(spec.cmd[4:])
        port = int(spec.url.rsplit(":", 1)[1])
        own = {
            "host": "127.0.0.1",
            "port": port,
            "device": "cpu",
            "role": "prefill" if i == 0 else "decode",
        }
        for p in SERVE:
            if p.name in own:
                assert getattr(child, p.name) == own[p.name], p.name
            elif p.how.replicas == ARGV or p.how.argument:
                assert getattr(child, p.name) == getattr(o, p.name), p.name
            else:
                assert getattr(child, p.name) == p.default, p.name
        assert not {"the-internal-key", "the-api-key"} & set(spec.cmd)
        assert spec.env[key_env("internal_key")] == "the-internal-key"
        assert spec.env[key_env("api_key")] == "the-api-key"
    router = seen["router"]
    assert router.replica == [s.url for s in specs]
    for p in params(RouterOptions):
        if p.how.shares:
            assert getattr(router, p.name) == getattr(o, p.how.shares), p.name


def test_data_parallel_without_internal_key_gives_one_fresh_key_to_all(data_parallel):
    seen = data_parallel
    r = CliRunner().invoke(
        cli.app, ["serve", str(DEMO), "--data-parallel-size", "3", "--device", "cpu"]
    )
    assert r.exit_code == 0, r.output
    key = seen["router"].internal_key
    assert key and all(s.env[key_env("internal_key")] == key for s in seen["specs"])
    assert key_env("api_key") not in seen["specs"][0].env
    assert all(key not in s.cmd for s in seen["specs"])


# -- tune, the engine, other command lines ---------------------------------------------------------


def test_tune_settings_are_the_tune_options_of_serve():
    serve = {p.name: p for p in SERVE}
    fields = dataclasses.fields(Setting)
    assert tuple(f.name for f in fields) == tune_settings() == SETTING_KEYS
    hints = typing.get_type_hints(Setting)
    for f in fields:
        assert hints[f.name] is serve[f.name].kind, f.name
        if f.default is not dataclasses.MISSING:
            assert f.default == serve[f.name].default, f.name


def test_engine_options_are_engine_config_fields():
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    kw = engine_kwargs(ServeOptions(artifact="m"))
    assert set(kw) <= names and kw["model"] == "m"
    assert len(kw) == sum(1 for p in SERVE if p.how.engine)
    for p in SERVE:  # an option EngineConfig also has is given to it
        if p.name in names and p.name != "artifact":
            assert p.how.engine, p.name


def test_serve_argv_knows_only_serves_options():
    assert serve_argv(
        {
            "artifact": "m",
            "max_num_seqs": 8,
            "max_queue": None,
            "enable_prefix_caching": False,
            "trust_remote_code": False,
        }
    ) == ["m", "--max-num-seqs", "8", "--no-enable-prefix-caching"]
    with pytest.raises(ValueError, match="'max_num_seq' is not a `runtime serve` option"):
        serve_argv({"max_num_seq": 8})
    from slimserve.runtime.bench.driver import ENGINE_FLAGS

    serve_argv(dict.fromkeys(ENGINE_FLAGS, 1))  # every flag bench passes on is one of serve's


def _string_constants(source: str) -> set[str]:
    return {
        n.value
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


@pytest.mark.parametrize(
    "where",
    ["runtime/cli.py", "runtime/tune/runner.py", "runtime/server/process.py", "serve_command"],
)
def test_no_serve_flag_is_spelled_by_hand(where):
    """Serve's flags are spelled in runtime/serve_options.py only: the commands, the replicas'
    and tune's command lines (and bench's `serve_command`) encode them from the table."""
    if where == "serve_command":
        from slimserve.runtime.bench import driver

        source = inspect.getsource(driver.serve_command)
    else:
        source = (REPO / where).read_text()
    spellings = {s for p in SERVE for s in _decls(p) | {p.flag}}
    assert not spellings & _string_constants(source)
