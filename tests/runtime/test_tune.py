"""`runtime tune` (runtime/tune/): the search on synthetic goodput curves (bracketing, bisection,
attainment, successive halving's economy), the report and the serve config it writes, the
prefix-caching decision, and the one-line errors of the command. The live run on the demo model
is marked slow (it starts several servers)."""

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slimserve.runtime import cli
from slimserve.runtime.bench.driver import BenchArgs
from slimserve.runtime.bench.workload import BenchRequest
from slimserve.runtime.serve_config import load_serve_config
from slimserve.runtime.serve_options import file_options
from slimserve.runtime.tune.command import (
    VLLM_DEFAULTS,
    Grid,
    check_slos,
    parse_grid,
    run_tune,
    search_space,
    shares_prefixes,
)
from slimserve.runtime.tune.search import (
    Evaluation,
    Setting,
    expected_runs,
    find_goodput,
    full_grid_runs,
    plan_rounds,
    successive_halving,
)

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo-model"


class Curves:
    """A synthetic server: each setting sustains `knee` req/s with every request in the SLO;
    above it the attained fraction falls linearly (to 0 at twice the knee). The rate-inf run
    reports `top` req/s and meets the SLO only when knee >= top."""

    def __init__(self, knees: dict[Setting, float], tops: dict[Setting, float] | None = None):
        self.knees = knees
        self.tops = tops or {s: 2.5 * k + 1 for s, k in knees.items()}
        self.calls: list[tuple[Setting, float, int]] = []

    def true_goodput(self, s: Setting, target: float) -> float:
        return min(self.tops[s], self.knees[s] * (2 - target))

    def __call__(self, s: Setting, rate: float, n: int) -> dict:
        self.calls.append((s, rate, n))
        knee, top = self.knees[s], self.tops[s]
        if math.isinf(rate):
            att, thr = (1.0 if knee >= top else 0.2), top
        else:
            att, thr = min(1.0, max(0.0, 2 - rate / knee)) if knee > 0 else 0.0, min(rate, top)
        lat = {"mean": 10.0, "median": 10.0, "p99": 100.0 * (2 - att)}
        return {
            "attainment": att,
            "request_throughput": thr,
            "completed": n,
            "failed": 0,
            "output_throughput": 30 * thr,
            "ttft_ms": lat,
            "tpot_ms": dict(lat),
        }


S = Setting(32, 512)


def test_bisection_brackets_the_goodput():
    curves = Curves({S: 3.3}, {S: 10.0})
    e = find_goodput(curves, S, num_prompts=16, target=1.0, steps=6)
    assert curves.calls[0] == (S, math.inf, 16) and e.max_throughput == 10.0
    assert e.runs == 7 and len(curves.calls) == 7 and not e.saturated
    lo, hi = e.bracket
    assert lo <= 3.3 < hi and hi - lo <= 2 * 10.0 / 2**6 + 1e-9  # bisection of (0, 2 T)
    assert e.goodput == lo and e.best_probe.rate == lo and e.probes[1].rate == 10.0  # T first
    for p in e.probes[1:]:  # every verdict agrees with the curve
        assert p.passed == (p.rate <= 3.3)
        assert (p.rate <= lo) if p.passed else (p.rate >= hi)


@pytest.mark.parametrize("target", [1.0, 0.9, 0.5])
def test_attainment_target_is_honoured(target):
    curves = Curves({S: 3.0}, {S: 12.0})
    e = find_goodput(curves, S, num_prompts=8, target=target, steps=8)
    true = curves.true_goodput(S, target)  # 3.0, 3.3, 4.5
    assert true - 2 * 12.0 / 2**8 <= e.goodput <= true
    assert all(p.attainment >= target for p in e.probes if p.passed)
    assert all(p.attainment < target for p in e.probes if not p.passed)


def test_saturated_and_never_met():
    sat = Curves({S: 20.0}, {S: 6.0})  # all requests at once still meet the SLO
    e = find_goodput(sat, S, num_prompts=8, target=0.9, steps=5)
    assert (e.saturated, e.goodput, e.runs) == (True, 6.0, 1)
    never = Curves({S: 0.0}, {S: 6.0})
    e = find_goodput(never, S, num_prompts=8, target=0.9, steps=4)
    assert (e.saturated, e.goodput, e.runs, e.best_probe) == (False, 0.0, 5, None)
    assert e.bracket == (0.0, 2 * 6.0 / 2**4)
    with pytest.raises(ValueError, match="attainment"):
        find_goodput(never, S, num_prompts=8, target=1.5, steps=2)


def test_a_prior_bracket_narrows_the_search_and_a_wrong_one_still_brackets():
    curves = Curves({S: 3.3}, {S: 10.0})
    plain = find_goodput(curves, S, num_prompts=8, target=1.0, steps=4)

    def prior(lo, hi):
        return Evaluation(S, 0, 4, 1, 10.0, lo, (lo, hi), False)

    curves.calls.clear()
    guided = find_goodput(curves, S, num_prompts=8, target=1.0, steps=4, prior=prior(3.0, 3.5))
    assert not any(math.isinf(r) for _, r, _ in curves.calls)  # T comes from the prior
    assert guided.runs == 4 and guided.max_throughput == 10.0

    def width(e: Evaluation) -> float:
        return e.bracket[1] - e.bracket[0]

    assert guided.bracket[0] <= 3.3 < guided.bracket[1]
    assert width(guided) < width(plain) / 4
    inherited = find_goodput(
        curves, S, num_prompts=8, target=1.0, steps=1, prior=prior(3.0, 3.5), inherit=True
    )  # one more bisection step
    assert [p.rate for p in inherited.probes] == [3.25] and inherited.bracket == (3.25, 3.5)
    for lo, hi in ((0.3, 0.5), (9.0, 10.0)):  # far below / above: walk out until it flips
        e = find_goodput(curves, S, num_prompts=8, target=1.0, steps=6, prior=prior(lo, hi))
        assert e.bracket[0] <= 3.3 < e.bracket[1], (lo, hi, e.bracket)


def test_plan_rounds():
    assert [(r.settings, r.num_prompts, r.steps) for r in plan_rounds(30, 64, 5)] == [
        (30, 8, 1),
        (15, 8, 1),
        (8, 16, 1),
        (4, 32, 1),
        (2, 64, 5),
    ]
    assert [(r.settings, r.num_prompts, r.steps) for r in plan_rounds(3, 48, 4)] == [
        (3, 24, 1),
        (2, 48, 4),
    ]
    assert [(r.settings, r.num_prompts, r.steps) for r in plan_rounds(1, 6, 1)] == [(1, 6, 1)]
    assert expected_runs(plan_rounds(30, 64, 5)) == 30 * 2 + 15 + 8 + 4 + 2 * 5
    for steps in (3, 4, 5):  # fewer runs than a full-precision grid
        for n in range(4 if steps == 3 else 3, 61):
            assert expected_runs(plan_rounds(n, 48, steps)) < full_grid_runs(n, steps), (n, steps)
    with pytest.raises(ValueError, match="empty"):
        plan_rounds(0, 8, 2)


def grid_knees() -> dict[Setting, float]:
    """A goodput landscape over the default grid with its peak at 32/512 (few sequences starve
    throughput, big token budgets stall decodes)."""
    grid = search_space([8, 16, 32, 64, 128, 256], [256, 512, 1024, 2048, 4096], ["auto"], [True])
    return {
        s: 6.0
        - abs(math.log2(s.max_num_seqs / 32)) * 0.7
        - abs(math.log2(s.max_num_batched_tokens / 512)) * 0.5
        for s in grid
    }


def test_successive_halving_finds_the_best_in_fewer_runs():
    knees = grid_knees()
    curves = Curves(knees)
    settings = list(knees)
    assert len(settings) == 30  # tokens >= seqs holds for the whole default grid
    result = successive_halving(curves, settings, target=0.9, num_prompts=64, steps=5)
    assert result.best.setting == Setting(32, 512)
    assert [len(r) for r in result.rounds] == [30, 15, 8, 4, 2]
    assert result.runs == len(curves.calls) <= expected_runs(result.plan)
    assert result.runs < full_grid_runs(len(settings), 5)  # 180 at full precision
    # and far fewer requests: most runs are the first round's short ones
    assert sum(n for _, _, n in curves.calls) < full_grid_runs(len(settings), 5) * 64 / 4
    assert sum(math.isinf(r) for _, r, _ in curves.calls) == 30  # rate inf in round 0 only
    for earlier, later in zip(result.rounds, result.rounds[1:]):  # the better half goes on
        assert {e.setting for e in later} == {e.setting for e in earlier[: len(later)]}
    prompts = {n for s, r, n in curves.calls if s == result.best.setting}
    assert max(prompts) == 64 and min(prompts) == 8
    for e in result.evaluations:  # every bracket holds the true goodput
        true = curves.true_goodput(e.setting, 0.9)
        assert e.bracket[0] <= true < e.bracket[1] or e.saturated, (e.setting, e.bracket, true)
    best = result.best
    assert best.bracket[1] - best.bracket[0] <= best.max_throughput / 2**4


def test_search_rejects_an_empty_or_repeated_space():
    with pytest.raises(ValueError, match="empty"):
        successive_halving(Curves({}), [], target=0.9, num_prompts=8, steps=2)
    with pytest.raises(ValueError, match="twice"):
        successive_halving(Curves({S: 1.0}), [S, S], target=0.9, num_prompts=8, steps=2)


def requests(n: int = 16, shared: bool = False) -> list[BenchRequest]:
    return [BenchRequest(([7] * 16 if shared else [i] * 16) + [1, 2, 3], "p", 8) for i in range(n)]


def tune_args(**kw) -> BenchArgs:
    return BenchArgs(
        model=str(DEMO),
        num_prompts=16,
        slo_ttft_ms=500.0,
        slo_tpot_ms=50.0,
        progress=False,
        device="cpu",
        **kw,
    )


def test_run_tune_reports_and_writes_what_serve_reads(tmp_path, capsys):
    knees = {s: k for s, k in grid_knees().items() if s.max_num_batched_tokens <= 1024}
    knees[VLLM_DEFAULTS] = 2.0  # vLLM's defaults, re-measured beside the winner
    curves = Curves(knees)
    settings = [s for s in knees if s != VLLM_DEFAULTS]
    res = run_tune(
        tune_args(),
        requests(),
        settings,
        "on",
        attainment=0.9,
        steps=3,
        min_prompts=4,
        compare_defaults=True,
        out=tmp_path,
        measure=curves,
    )
    fin = res["final"]
    assert res["search"]["winner"] == fin["tuned"]["label"] == "32/512"
    assert fin["defaults"]["label"] == "256/2048" and not fin["kept_defaults"]
    assert fin["tuned"]["goodput"] > fin["defaults"]["goodput"]
    assert res["total"]["runs"] == len(curves.calls) == res["search"]["runs"] + fin["runs"]
    assert res["search"]["runs"] < res["search"]["full_grid_runs"]
    cfg = load_serve_config(tmp_path / "serve.yaml", file_options())
    assert cfg == {"artifact": str(DEMO), "device": "cpu", **Setting(32, 512).flags()}
    saved = json.loads((tmp_path / "tune.json").read_text())
    assert saved["final"]["tuned"]["probes"][0]["rate"] == "inf"
    assert len(saved["search"]["rounds"]) == len(saved["plan"])
    assert (tmp_path / "tune.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    for text in (
        "runtime tune",
        "goodput",
        "vLLM defaults",
        "benchmark runs",
        "serve.yaml",
        f"search: {res['search']['runs']} benchmark runs",
    ):
        assert text in out


def test_run_tune_keeps_the_defaults_when_they_measure_better(tmp_path, capsys):
    knees = {Setting(8, 256): 1.0, Setting(16, 256): 1.5, VLLM_DEFAULTS: 4.0}
    run_tune(
        tune_args(),
        requests(),
        [Setting(8, 256), Setting(16, 256)],
        "on",
        attainment=0.9,
        steps=3,
        min_prompts=4,
        compare_defaults=True,
        out=tmp_path,
        measure=Curves(knees),
    )
    cfg = load_serve_config(tmp_path / "serve.yaml", file_options())
    assert (cfg["max_num_seqs"], cfg["max_num_batched_tokens"]) == (256, 2048)
    assert "keeps the defaults" in capsys.readouterr().out


def test_run_tune_without_the_defaults_and_with_a_saturated_setting(tmp_path, capsys):
    knees = {Setting(8, 256): 50.0, Setting(16, 256): 1.5, Setting(32, 256): 1.0}  # 8/256 saturates
    curves = Curves(knees, {Setting(8, 256): 5.0, Setting(16, 256): 4.0, Setting(32, 256): 3.5})
    res = run_tune(
        tune_args(),
        requests(),
        list(knees),
        "on",
        attainment=0.9,
        steps=3,
        min_prompts=4,
        compare_defaults=False,
        out=tmp_path,
        measure=curves,
    )
    assert res["final"]["defaults"] is None and res["final"]["tuned"]["saturated"]
    assert res["final"]["tuned"]["goodput"] == curves.tops[Setting(8, 256)]
    assert all(s != VLLM_DEFAULTS for s, _, _ in curves.calls)
    assert res["final"]["runs"] == 1  # a saturated setting is one rate-inf run
    assert "vLLM defaults" not in capsys.readouterr().out
    assert load_serve_config(tmp_path / "serve.yaml", file_options())["max_num_seqs"] == 8


def test_prefix_caching_is_searched_only_where_it_applies():
    assert not shares_prefixes(requests()) and shares_prefixes(requests(shared=True))
    grid = Grid([8], [256, 512], ["auto"], "auto")
    settings, note = grid.settings(requests())
    assert [s.enable_prefix_caching for s in settings] == [True, True] and "kept on" in note
    settings, note = grid.settings(requests(shared=True))
    assert sorted(s.enable_prefix_caching for s in settings) == [False, False, True, True]
    assert len(parse_grid("8,16", "8,256", "auto,fp8_e4m3", "both").settings([])[0]) == 12
    # int8 / int4 caches are searched when listed, and each setting serves with its own
    settings = parse_grid("8", "256", "auto,int8,int4", "on").settings([])[0]
    assert [s.kv_cache_dtype for s in settings] == ["auto", "int8", "int4"]


@pytest.mark.parametrize(
    "args, needle",
    [
        ([], "give an SLO"),
        (["--slo-ttft-p99", "0"], "--slo-ttft-p99 0: must be a positive"),
        (["--slo-tpot-p99", "-5"], "--slo-tpot-p99 -5: must be a positive"),
        (["--slo-tpot-ms", "inf"], "must be a positive"),
        (["--slo-tpot-p99", "50", "--attainment", "1.5"], "--attainment 1.5: must be in (0, 1]"),
        (
            ["--slo-tpot-p99", "50", "--max-num-seqs", "512", "--max-num-batched-tokens", "256"],
            "the grid is empty",
        ),
        (["--slo-tpot-p99", "50", "--max-num-seqs", "8,x"], "--max-num-seqs '8,x': give positive"),
        (["--slo-tpot-p99", "50", "--kv-cache-dtype", "int2"], "--kv-cache-dtype 'int2'"),
        (["--slo-tpot-p99", "50", "--prefix-caching", "maybe"], "--prefix-caching 'maybe'"),
        (["--slo-tpot-p99", "50", "--dataset", "/nonexistent/p.jsonl"], "no such file"),
        (["--slo-tpot-p99", "50", "--bisect-steps", "0"], "--bisect-steps 0"),
    ],
)
def test_command_errors_are_one_line(args, needle):
    r = CliRunner().invoke(cli.app, ["tune", str(DEMO), *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_bad_workload_files_are_one_line(tmp_path):
    path = tmp_path / "p.jsonl"
    for body, needle in [
        ('{"prompt": "a"}\n{"text": "b"}\n', "p.jsonl:2: needs a non-empty"),
        ('{"prompt": "a", "output_len": "many"}\n', 'p.jsonl:1: "output_len"'),
        ('{"prompt": "a", "output_len": 0}\n', "must be a positive integer"),
    ]:
        path.write_text(body)
        r = CliRunner().invoke(
            cli.app, ["tune", str(DEMO), "--slo-ttft-p99", "100", "--dataset", str(path)]
        )
        assert r.exit_code == 2 and needle in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(cli.app, ["tune", str(tmp_path / "nomodel"), "--slo-ttft-p99", "100"])
    assert r.exit_code == 2 and "no such folder" in r.output, r.output


def test_check_slos_accepts_one_term():
    check_slos(None, 40.0, 0.9)
    check_slos(800.0, None, 1.0)


@pytest.mark.slow
def test_live_tune_on_the_demo_model(tmp_path):
    """Two settings, a few short requests: real servers started through `serve --config`."""
    r = CliRunner().invoke(
        cli.app,
        [
            "tune",
            str(DEMO),
            "--slo-ttft-p99",
            "2000",
            "--slo-tpot-p99",
            "200",
            "--max-num-seqs",
            "4,16",
            "--max-num-batched-tokens",
            "256",
            "--num-prompts",
            "6",
            "--bisect-steps",
            "1",
            "--input-len-median",
            "32",
            "--input-len-min",
            "16",
            "--input-len-max",
            "64",
            "--output-len-median",
            "8",
            "--output-len-min",
            "4",
            "--output-len-max",
            "16",
            "--device",
            "cpu",
            "--no-progress",
            "--out",
            str(tmp_path),
        ],
    )
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "tune.json").read_text())
    assert res["search"]["server_starts"] == 2 and res["final"]["defaults"]["label"] == "256/2048"
    assert all(
        p["metrics"]["failed"] == 0
        for rnd in res["search"]["rounds"]
        for e in rnd
        for p in e["probes"]
    )
    cfg = load_serve_config(tmp_path / "serve.yaml", file_options())
    assert cfg["max_num_batched_tokens"] in (256, 2048) and cfg["device"] == "cpu"
    assert len(list((tmp_path / "servers").glob("server-*.yaml"))) >= 3


def test_no_probe_runs_slower_than_max_probe_s():
    """A setting that misses the SLO at every rate is not chased towards rate 0 (a run at 0.01
    req/s of 48 prompts would take over an hour): the floor num_prompts / max_probe_s bounds
    every probe, and failing there is goodput 0."""
    rates = []

    def measure(setting, rate, num_prompts):
        rates.append(rate)
        return {
            "request_throughput": 4.0 if math.isinf(rate) else min(rate, 4.0),
            "attainment": 0.0,
            "completed": num_prompts,
            "failed": 0,
        }

    ev = find_goodput(
        measure, Setting(8, 512), num_prompts=48, target=0.9, steps=6, max_probe_s=60.0
    )
    finite = [r for r in rates if math.isfinite(r)]
    assert finite and min(finite) >= 48 / 60.0
    assert ev.goodput == 0.0 and len(finite) < 6  # stopped once the floor failed
