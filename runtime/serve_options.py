"""The options of `runtime serve` and `runtime router`: each one defined once, here.

`ServeOptions` is the table of `runtime serve`: one field per option, in --help order, giving
its type, default, flag spellings and help, and where else the value goes:

  file      a key of the `--config` file (runtime/serve_config.py); every option but --config
  replicas  how the N children of `--data-parallel-size N` get it: ARGV (on their command line,
            re-encoded from the value), ENV (in their environment, under the option's envvar:
            keys, which `ps` would show to every user on a command line) or OWN (the parent's
            own: used there, or set per replica: host, port, device, role)
  engine    the EngineConfig field it sets (True: the field of the same name)
  tune      a setting axis of `runtime tune` (runtime/tune/search.py, `Setting`)

`RouterOptions` is the table of `runtime router`: its own options, and those it shares with
serve (`shared`: serve's definition, with the router's own words where they differ), which a
`--data-parallel-size` deployment hands from serve to its router (`router_options`).

Everything else is derived from the two tables: the typer commands' parameters
(`typer_command`, `typer_param`), the `--config` schema (`file_options`), the replicas' command
line and environment (`replica_argv`, `replica_env`), any `runtime serve` command line another
module builds (`serve_argv`: runtime tune, runtime bench), the engine config (`engine_kwargs`)
and tune's setting axes (`tune_settings`). Adding a flag is one field here;
tests/runtime/test_serve_options.py checks that each field reaches every one of those places.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import typer

from slimserve.runtime.config import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_STEP_WATCHDOG_S,
    DEFAULT_STREAM_TIMEOUT_S,
    EngineConfig,
)
from slimserve.runtime.router.replicas import POLL_INTERVAL_S
from slimserve.runtime.serve_config import OptionSpec
from slimserve.runtime.server.trust import INTERNAL_KEY_ENV

ARGV, ENV, OWN = "argv", "env", "own"  # how the replicas of --data-parallel-size get an option
API_KEY_ENV = "SLIMSERVE_API_KEY"
ROUTER_ADMIN_KEY_ENV = "SLIMSERVE_ROUTER_ADMIN_KEY"
_ENGINE = {f.name: f.default for f in dataclasses.fields(EngineConfig)}  # the engine's defaults


@dataclass(frozen=True, slots=True)
class How:
    """How one option is spelled and where its value goes (the module docstring)."""

    flags: tuple[str, ...] = ()  # typer's spellings; (): typer's own (--name, --name/--no-name)
    help: str | None = None
    min: float | None = None
    max: float | None = None
    envvar: str | None = None
    argument: bool = False  # the positional MODEL
    eager: bool = False  # parsed first (--config, whose file gives the other options' defaults)
    file: bool = True
    replicas: str = ARGV
    engine: bool | str = False
    tune: bool = False
    shares: str | None = None  # (RouterOptions) the ServeOptions field this option is


def option(default: Any = ..., *flags: str, **how: Any) -> Any:
    """One field of an options table: its default (`...`: required) and `How(flags, **how)`."""
    meta = {"how": How(flags, **how)}
    return field(metadata=meta) if default is ... else field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """Every option of `runtime serve`, in --help order (the module docstring)."""

    artifact: str = option(
        argument=True,
        replicas=OWN,
        engine="model",
        help=(
            "slimserve artifact or HF checkpoint folder, or a .gguf file (or pkg:<module> shipping "
            "one); may come from --config's `model`"
        ),
    )
    config: str | None = option(
        None,
        "--config",
        eager=True,
        file=False,
        replicas=OWN,
        help=(
            "YAML file of serve options (option names as keys, e.g. max_num_seqs: 32; `model` for "
            "MODEL); flags given here override it; `runtime tune` writes one"
        ),
    )
    host: str = option(
        "127.0.0.1", replicas=OWN, help="interface to listen on (0.0.0.0: every one)"
    )
    port: int = option(8000, min=0, max=65535, replicas=OWN)
    max_num_seqs: int = option(
        _ENGINE["max_num_seqs"], engine=True, tune=True, help="sequences per batch at most"
    )
    max_num_batched_tokens: int = option(
        _ENGINE["max_num_batched_tokens"],
        engine=True,
        tune=True,
        help="tokens (prefill chunks + decodes) per step",
    )
    max_model_len: int | None = option(
        None, engine=True, help=("prompt + output tokens per request (default: the model's)")
    )
    block_size: int = option(_ENGINE["block_size"], engine=True, help="tokens per KV-cache block")
    kv_cache_dtype: str = option(
        _ENGINE["kv_cache_dtype"],
        engine=True,
        tune=True,
        help=(
            "auto | fp8_e4m3 | int8 | int4 (int8/int4: scales per token and KV head, no "
            "calibration; auto: the artifact's)"
        ),
    )
    kv_cache_dtype_skip_layers: str | None = option(
        None,
        "--kv-cache-dtype-skip-layers",
        engine="kv_cache_skip_layers",
        help=(
            "with an fp8, int8 or int4 KV cache, layers whose K/V stay unquantized, e.g. 1,16 (none: every "
            "layer fp8); default: the artifact's (slimserve.json)"
        ),
    )
    kv_cache_memory: str | None = option(
        None,
        engine=True,
        help=("KV-cache size, e.g. 2GiB (default: 90% of free GPU memory; 512MiB on CPU)"),
    )
    enable_prefix_caching: bool = option(
        _ENGINE["enable_prefix_caching"],
        "--enable-prefix-caching/--no-enable-prefix-caching",
        engine=True,
        tune=True,
    )
    cuda_graphs: bool | None = option(
        _ENGINE["cuda_graphs"],
        "--cuda-graphs/--enforce-eager",
        engine=True,
        help=(
            "replay decode-only steps from CUDA graphs; default: on for a one-GPU engine on the "
            "kernel path (fp16/bf16), off on the CPU, for fp32 and with -tp/-pp"
        ),
    )
    api_key: str | None = option(
        None, envvar=API_KEY_ENV, replicas=ENV, help="require 'Authorization: Bearer KEY' on /v1/*"
    )
    internal_key: str | None = option(
        None,
        "--internal-key",
        envvar=INTERNAL_KEY_ENV,
        replicas=ENV,
        help=(
            "the deployment's internal key, required as X-Slimserve-Internal-Key by the KV "
            "hand-over (--role), /kv_segments, /reset_prefix_cache and the profiler endpoints, "
            "which are refused without one (with --data-parallel-size: default a fresh one, "
            "given to every replica)"
        ),
    )
    require_cache_salt: bool = option(
        False,
        "--require-cache-salt",
        help=("refuse /v1 requests without a cache_salt (tenants never share prefix-cache blocks)"),
    )
    kv_segments_max: int = option(
        64,
        "--kv-segments-max",
        min=1,
        help=(
            "KV segments a decode server holds at most (received, not yet imported); more: 503 + "
            "Retry-After"
        ),
    )
    kv_segments_max_bytes: str | None = option(
        None,
        "--kv-segments-max-bytes",
        help=(
            "bytes of those segments at most, e.g. 4GiB (default: 4 prompts of the whole context)"
        ),
    )
    max_queue: int | None = option(
        None,
        min=1,
        help=("answer 503 + Retry-After while this many requests wait (default: no limit)"),
    )
    max_connections: int = option(
        DEFAULT_MAX_CONNECTIONS, min=1, help="open connections at most; more get 503"
    )
    body_timeout: float = option(
        DEFAULT_BODY_TIMEOUT_S, min=0.1, help="s a request body may take to arrive; later: 408"
    )
    stream_timeout: float = option(
        DEFAULT_STREAM_TIMEOUT_S,
        min=0.1,
        help=("s a streaming client may read nothing before its request is aborted"),
    )
    step_watchdog: float = option(
        DEFAULT_STEP_WATCHDOG_S,
        min=0.1,
        help="s one engine step may take before /health answers 503",
    )
    served_model_name: str | None = option(
        None, engine=True, help=("model name in the API (default: the folder's name)")
    )
    # each replica gets one GPU (cuda) or a share of the cores (cpu) from the parent
    device: str = option(
        _ENGINE["device"], replicas=OWN, engine=True, help="auto | cpu | cuda | cuda:N"
    )
    dtype: str = option(_ENGINE["dtype"], engine=True, help="auto | float16 | bfloat16 | float32")
    cpu_threads: str = option(
        _ENGINE["cpu_threads"],
        "--cpu-threads",
        engine=True,
        help=(
            "CPU compute threads: auto (every usable core, fewer while other processes keep "
            "cores busy; capped by OMP_NUM_THREADS) | N (fixed)"
        ),
    )
    trust_remote_code: bool = option(False, "--trust-remote-code", engine=True)
    verify: str = option(
        "strict",
        "--verify",
        engine=True,
        help=(
            "strict: a slimserve artifact must have a slimserve.json matching every file (plain HF "
            "checkpoints load as they are) | none: skip the manifest check"
        ),
    )
    allow_failed_gate: bool = option(
        False,
        "--allow-failed-gate",
        engine=True,
        help=(
            "load an artifact whose perplexity gate failed (its slimserve.json says so; refused "
            "otherwise)"
        ),
    )
    # -tp/-pp/the executor are OWN: --data-parallel-size refuses -tp/-pp > 1 (one rank a replica)
    tensor_parallel_size: int = option(
        1,
        "--tensor-parallel-size",
        "-tp",
        replicas=OWN,
        engine=True,
        help=(
            "split the model over N ranks (processes: one GPU "
            "each on CUDA, cores / N threads each on CPU; "
            "runtime/distributed/)"
        ),
    )
    pipeline_parallel_size: int = option(
        1,
        "--pipeline-parallel-size",
        "-pp",
        replicas=OWN,
        engine=True,
        help=(
            "split the layers into M pipeline stages (processes, as -tp; with -tp N: N x M ranks)"
        ),
    )
    distributed_executor_backend: str = option(
        "mp",
        "--distributed-executor-backend",
        replicas=OWN,
        engine=True,
        help=(
            "how -tp/-pp ranks start: mp (processes on this machine) | ray (Ray actors, one per "
            'GPU, on a Ray cluster\'s nodes; pip install -e ".[ray]")'
        ),
    )
    data_parallel_size: int = option(
        1,
        "--data-parallel-size",
        min=1,
        replicas=OWN,
        help=(
            "engine replicas (processes; one GPU each on CUDA, an equal share of the cores on CPU) "
            "behind one router"
        ),
    )
    router_policy: str = option(
        "least-latency",
        "--router-policy",
        replicas=OWN,
        help=("with --data-parallel-size > 1: least-latency | round-robin | random"),
    )
    role: str = option(
        "colocated",
        "--role",
        replicas=OWN,
        help=(
            "colocated (prefill and decode here) | prefill (a router sends this replica prompts to "
            "prefill and hands their KV to a decode replica on the same host) | decode"
        ),
    )
    prefill_replicas: int = option(
        0,
        "--prefill-replicas",
        min=0,
        replicas=OWN,
        help=(
            "with --data-parallel-size N: this many replicas prefill (--role prefill), the other "
            "N - K decode (0: all colocated)"
        ),
    )
    profile_dir: str | None = option(
        None,
        "--profile-dir",
        help=(
            "enable POST /start_profile and /stop_profile, which write torch profiler traces of the "
            "engine steps here (created if missing)"
        ),
    )


def shared(name: str, **how: Any) -> Any:
    """A RouterOptions field that is ServeOptions' `name`: its default, type and spellings, with
    `how` overriding what the router says differently (its help, its flags)."""
    source = ServeOptions.__dataclass_fields__[name]
    meta = {"how": dataclasses.replace(source.metadata["how"], shares=name, **how)}
    return field(default=source.default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class RouterOptions:
    """Every option of `runtime router`, in --help order: its own, and serve's it `shared`s."""

    replica: list[str] = option(
        ...,
        "--replica",
        help=("base URL of a `runtime serve` replica, e.g. http://10.0.0.2:8000; repeat for each"),
    )
    policy: str = shared("router_policy", flags=(), help="least-latency | round-robin | random")
    host: str = shared("host")
    port: int = shared("port")
    api_key: str | None = shared(
        "api_key", help=("require 'Authorization: Bearer KEY' on /v1/* (forwarded to the replicas)")
    )
    admin_key: str | None = option(
        None,
        envvar=ROUTER_ADMIN_KEY_ENV,
        help=(
            "allow POST/DELETE /router/replicas with 'Authorization: Bearer KEY' (default: the "
            "replica list is fixed)"
        ),
    )
    internal_key: str | None = shared(
        "internal_key",
        help=(
            "the replicas' --internal-key: sent on KV hand-overs (needed for prefill/decode roles) "
            "and POST /reset_prefix_cache, and required from callers of the router's own"
        ),
    )
    poll_interval: float = option(
        POLL_INTERVAL_S,
        min=0.01,
        help=("s between polls of each replica's /state (health and load)"),
    )
    max_connections: int = shared("max_connections")
    body_timeout: float = shared("body_timeout")
    stream_timeout: float = shared(
        "stream_timeout",
        help=("s a streaming client may read nothing before its request is dropped"),
    )


# -- what the tables resolve to ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Param:
    """One field of an options table, resolved: its name, annotation, value type and default."""

    name: str
    annotation: Any  # as typer reads it: str, Optional[int], list[str], ...
    kind: type  # the value's type: bool, int, float, str or list
    default: Any  # ... when required
    how: How

    def typer_info(self, callback: Callable | None = None) -> Any:
        """The typer.Argument / typer.Option that declares it (`callback`: the option's)."""
        h = self.how
        if h.argument:
            return typer.Argument(self.default, help=h.help)
        return typer.Option(
            self.default,
            *h.flags,
            help=h.help,
            min=h.min,
            max=h.max,
            envvar=h.envvar,
            is_eager=h.eager,
            callback=callback,
        )

    @property
    def switch(self) -> tuple[str, str | None]:
        """A flag's (on, off) spellings; off is None for a flag that is only ever turned on."""
        dash = "--" + self.name.replace("_", "-")
        decls = self.how.flags or (f"{dash}/--no-{dash[2:]}",)
        for decl in decls:
            if "/" in decl:
                on, off = (s.strip() for s in decl.split("/", 1))
                return on, off
        return next(d for d in decls if d.startswith("--")), None

    @property
    def flag(self) -> str:
        """The long spelling that sets the option (what argv encodings use)."""
        if self.kind is bool:
            return self.switch[0]
        return next(
            (d for d in self.how.flags if d.startswith("--")), "--" + self.name.replace("_", "-")
        )

    def argv(self, value: Any) -> list[str]:
        """`value` as command-line words (none for None, or for an off flag without an off form)."""
        if value is None:
            return []
        if self.how.argument:
            return [str(value)]
        if self.kind is bool:
            on, off = self.switch
            return [on] if value else [off] if off is not None else []
        if self.kind is list:
            return [w for v in value for w in (self.flag, str(v))]
        return [self.flag, str(value)]


def _kind(annotation: Any) -> type:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]  # Optional[X] or X | None
    return typing.get_origin(annotation) or annotation


@functools.cache
def params(table: type) -> tuple[Param, ...]:
    """The table's fields resolved, in order; refuses a field that cannot work as declared."""
    hints = typing.get_type_hints(table)
    out = []
    for f in dataclasses.fields(table):
        how = f.metadata["how"]
        default = ... if f.default is dataclasses.MISSING else f.default
        p = Param(f.name, hints[f.name], _kind(hints[f.name]), default, how)
        if (
            how.shares is not None
            and hints[f.name] != (src := by_name(ServeOptions)[how.shares]).annotation
        ):
            raise TypeError(
                f"{table.__name__}.{f.name} shares ServeOptions.{src.name}: annotate "
                f"it {src.annotation!r}"
            )
        if table is ServeOptions and how.envvar and how.replicas == ARGV:
            raise ValueError(
                f"{table.__name__}.{f.name} is read from ${how.envvar} (a key): give "
                "it to the replicas in their environment (replicas=ENV), never argv"
            )
        if p.kind is bool and p.switch[1] is None and default is not False:
            raise ValueError(
                f"{table.__name__}.{f.name}: a flag without an off spelling must "
                "default to False; declare it as '--on/--off'"
            )
        out.append(p)
    return tuple(out)


def by_name(table: type) -> dict[str, Param]:
    return {p.name: p for p in params(table)}


# -- the typer commands ----------------------------------------------------------------------------


def typer_command(table: type, callbacks: Mapping[str, Callable] | None = None):
    """Decorator: `fn(opts: table)` becomes a typer command function whose parameters are the
    table's fields (a signature built from them), called with the parsed values as one `table`.
    `callbacks`: typer callbacks of some options, by name (e.g. --config's)."""
    callbacks = dict(callbacks or {})
    ps = params(table)
    if unknown := set(callbacks) - {p.name for p in ps}:
        raise ValueError(f"callbacks for unknown options of {table.__name__}: {sorted(unknown)}")

    def wrap(fn: Callable[[Any], Any]) -> Callable[..., Any]:
        def run(**values: Any) -> Any:
            return fn(table(**values))

        run.__signature__ = inspect.Signature(
            [
                inspect.Parameter(
                    p.name,
                    inspect.Parameter.POSITIONAL_OR_KEYWORD,
                    default=p.typer_info(callbacks.get(p.name)),
                    annotation=p.annotation,
                )
                for p in ps
            ]
        )
        run.__annotations__ = {**{p.name: p.annotation for p in ps}, "return": None}
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(run, attr, getattr(fn, attr))
        return run

    return wrap


def typer_param(name: str) -> Any:
    """ServeOptions' `name` declared for another command that takes the same option (generate)."""
    return by_name(ServeOptions)[name].typer_info()


# -- where serve's values go ---------------------------------------------------------------------


def serve_argv(values: Mapping[str, Any]) -> list[str]:
    """`runtime serve` command-line words for `values` (option name -> value, in that order;
    None: left out, so serve's default holds)."""
    options = by_name(ServeOptions)
    if unknown := [n for n in values if n not in options]:
        raise ValueError(
            f"{unknown[0]!r} is not a `runtime serve` option (runtime/serve_options.py)"
        )
    return [w for name, value in values.items() for w in options[name].argv(value)]


def replica_argv(o: ServeOptions) -> list[str]:
    """What every replica of `--data-parallel-size` gets on its command line: the ARGV options."""
    return serve_argv(
        {p.name: getattr(o, p.name) for p in params(ServeOptions) if p.how.replicas == ARGV}
    )


def replica_env(o: ServeOptions) -> dict[str, str]:
    """What every replica gets in its environment: the ENV options that are set."""
    return {
        p.how.envvar: str(v)
        for p in params(ServeOptions)
        if p.how.replicas == ENV and (v := getattr(o, p.name)) is not None
    }


def router_options(o: ServeOptions, replicas: list[str]) -> RouterOptions:
    """The router of a `--data-parallel-size` deployment over `replicas`: serve's values of the
    options the two share, the router's defaults for its own."""
    return RouterOptions(
        replica=list(replicas),
        **{p.name: getattr(o, p.how.shares) for p in params(RouterOptions) if p.how.shares},
    )


def engine_kwargs(o: ServeOptions) -> dict[str, Any]:
    """EngineConfig's keyword arguments from serve's options."""
    return {
        (p.name if p.how.engine is True else p.how.engine): getattr(o, p.name)
        for p in params(ServeOptions)
        if p.how.engine
    }


def file_options() -> dict[str, OptionSpec]:
    """The `--config` file's schema (runtime/serve_config.py): the file options' names, value
    types and ranges."""
    return {
        p.name: OptionSpec(
            p.name,
            p.kind if p.kind in (bool, int, float, str) else str,
            p.how.min,
            p.how.max,
            p.how.argument,
        )
        for p in params(ServeOptions)
        if p.how.file
    }


def tune_settings() -> tuple[str, ...]:
    """The serve options `runtime tune` searches, in table order."""
    return tuple(p.name for p in params(ServeOptions) if p.how.tune)


def serve_default(name: str) -> Any:
    return by_name(ServeOptions)[name].default
