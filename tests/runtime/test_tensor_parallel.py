"""Tensor and pipeline parallelism (runtime/distributed/) on CPU with gloo: the same greedy
tokens as one process, sizes refused before loading, and a killed worker ending the engine
instead of hanging.

Engines with `tensor_parallel_size=2` start a worker process each (spawn), so they are shared
per module; the demo model runs in float32, where the only difference from one process is the
summation order of the row-parallel all-reduces.
"""

import copy
import os
import signal
import time

import pytest
import torch
from typer.testing import CliRunner

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.distributed.sharding import check_tensor_parallel
from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.llm import LLM
from slimserve.runtime.models.llama import model_spec
from slimserve.runtime.worker.executor import WorkerDiedError
from tests.helpers import DEMO_MODEL
from tests.helpers.metrics_text import step_metrics

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
ENGINE = {"device": "cpu", "dtype": "float32", "kv_cache_memory": 16 * 2**20}


def _prompts(n: int = 16) -> list[str]:
    from slimserve.runtime.corpus import read_texts

    texts = [t for t in read_texts("validation") if len(t) > 200]
    return [t[i * 37 % 150 : i * 37 % 150 + 40 + 7 * i] for i, t in enumerate(texts[:n])]


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _compare(one: list[list[int]], two: list[list[int]], params) -> None:
    assert len(one) == len(two) and all(len(t) == params.max_tokens for t in one)
    for i, (a, b) in enumerate(zip(one, two)):
        assert a == b, (
            f"prompt {i}: tensor-parallel tokens differ at {next(j for j in range(len(a)) if a[j] != b[j])}"
        )


def _same_tokens_as_one_process(path, prompts, params=GREEDY):
    one = _tokens(LLM(str(path), **ENGINE), prompts, params)
    tp = LLM(str(path), **ENGINE, tensor_parallel_size=2)
    try:
        two = _tokens(tp, prompts, params)
        assert tp.engine.runner.comm_stats()["comm_calls"] > 0  # the shards really talked
    finally:
        tp.shutdown()
    _compare(one, two, params)


@pytest.fixture(scope="module")
def demo_reference() -> tuple[list[str], list[list[int]]]:
    """The 16 prompts and the demo model's greedy tokens from one process."""
    prompts = _prompts()
    return prompts, _tokens(LLM(str(DEMO_MODEL), **ENGINE), prompts)


@pytest.fixture(scope="module")
def demo_tp2():
    """One TP=2 engine of the demo model for the module; the last test kills its worker."""
    llm = LLM(str(DEMO_MODEL), **ENGINE, tensor_parallel_size=2)
    yield llm
    llm.shutdown()


def test_demo_model_tp2_generates_the_tokens_of_one_process(demo_tp2, demo_reference):
    prompts, one = demo_reference
    before = demo_tp2.engine.runner.comm_stats()
    two = _tokens(demo_tp2, prompts)
    after = demo_tp2.engine.runner.comm_stats()
    # per step: 2 all-reduces per layer, the embedding's all-reduce, the logits gather
    steps = after["steps"] - before["steps"]
    assert steps >= 64 and after["comm_calls"] - before["comm_calls"] == steps * (2 * 4 + 2)
    _compare(one, two, GREEDY)
    runner = demo_tp2.engine.runner
    assert runner.kv_heads == 1 and runner.kv_caches[0][0].shape[2] == 1  # its own KV head only


def test_two_pipeline_stages_generate_the_tokens_of_one_process(demo_reference):
    """Layers 0-1 on rank 0, 2-3 on rank 1; each step in two micro-batches."""
    prompts, one = demo_reference
    pp = LLM(str(DEMO_MODEL), **ENGINE, pipeline_parallel_size=2)
    try:
        runner = pp.engine.runner
        assert runner.model.spec.num_layers == 2 and len(runner.kv_caches) == 2
        assert runner.model.lm_head is None  # the last stage's, not rank 0's
        before = runner.comm_stats()
        two = _tokens(pp, prompts)
        after = runner.comm_stats()
        rows = runner.rank_stats()  # stage 1 reports its own weights: the lm_head, no embedding
        assert [r.rank for r in rows] == [0, 1] and rows[0].weight_bytes == runner.weight_bytes
        assert rows[1].weight_bytes > 0 and rows[1].weight_bytes != rows[0].weight_bytes
        assert rows[1].kv_cache_bytes == runner.kv_cache_bytes and rows[1].memory_bytes > 0
    finally:
        pp.shutdown()
    steps = after["steps"] - before["steps"]
    # rank 0 per step: a send of each micro-batch's activations, a receive of each one's logits
    assert steps >= 64 and after["comm_calls"] - before["comm_calls"] == 4 * steps
    _compare(one, two, GREEDY)


@pytest.mark.slow  # four processes on this 2-core machine
def test_tp2_by_pp2_generates_the_tokens_of_one_process(demo_reference):
    """Ranks 0-1: layers 0-1 split in two; ranks 2-3: layers 2-3 split in two."""
    prompts, one = demo_reference
    llm = LLM(str(DEMO_MODEL), **ENGINE, tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        runner = llm.engine.runner
        assert (
            runner.model.spec.num_layers == 2
            and runner.kv_heads == 1
            and runner.tp_group is not None
        )
        two = _tokens(llm, prompts)
    finally:
        llm.shutdown()
    _compare(one, two, GREEDY)


def test_stage_layer_ranges_and_micro_batches():
    from slimserve.runtime.batch import prepare_batch
    from slimserve.runtime.distributed.pipeline import split_batch, stage_layers

    assert stage_layers(4, 2) == [range(2), range(2, 4)]
    assert stage_layers(5, 3) == [range(2), range(2, 4), range(4, 5)]
    with pytest.raises(ValueError, match="at most 4"):
        stage_layers(4, 5)
    batch = prepare_batch(
        [[5, 6, 7], [9], [1, 2]],
        [0, 20, 3],
        [[3], [1, 4], [2]],
        [True, False, True],
        16,
        torch.device("cpu"),
    )
    a, b = split_batch(batch)
    assert (
        a.input_ids.tolist() == [5, 6, 7] and a.logits_indices.tolist() == [2] and not a.decode_only
    )
    assert b.input_ids.tolist() == [9, 1, 2] and b.cu_seqlens_q.tolist() == [0, 1, 3]
    assert b.logits_indices.tolist() == [2] and b.max_context_len == 21 and b.max_q_len == 2
    assert (
        b.block_tables.tolist() == [[1, 4], [2, 0]]
        and b.slot_mapping.tolist() == batch.slot_mapping[3:].tolist()
    )


def _gptq_artifact(out, act_order: bool, fmt: str = "gptq", base=DEMO_MODEL, args=None):
    """`base` fake-quantized to 4 bits in groups of 64 (asymmetric) and exported as `fmt` (the
    demo model's o_proj: 384 input columns split into 2 x 192 = 3 whole groups per rank)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from slimserve.compress.export.formats import export_artifact
    from slimserve.compress.quant.primitives import compute_qparams, quantize, quantize_weight
    from slimserve.runtime.artifact.manifest import ArtifactManifest
    from slimserve.runtime.artifact.qweight import QuantizedWeight
    from slimserve.runtime.artifact.scheme import QuantArgs

    args = args or QuantArgs(4, group_size=64, symmetric=False)
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()
    quantized = {}
    with torch.no_grad():
        for i, (name, mod) in enumerate(model.named_modules()):
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                if act_order:  # a shuffled g_idx: every rank keeps every group's scales
                    a = args.with_(actorder="group")
                    k = mod.weight.shape[1]
                    gen = torch.Generator().manual_seed(i)
                    g_idx = (torch.argsort(torch.randperm(k, generator=gen)) // 64).to(torch.int32)
                    scale, zp = compute_qparams(mod.weight, a, mod.weight.dtype, g_idx)
                    qw = QuantizedWeight(
                        quantize(mod.weight, scale, zp, a, g_idx.long()), scale, zp, g_idx, a
                    )
                else:
                    qw = quantize_weight(mod.weight, args)
                quantized[name] = qw
                mod.weight.copy_(qw.dequantize(torch.bfloat16))
    tok = AutoTokenizer.from_pretrained(base)
    return export_artifact(
        fmt, copy.deepcopy(model), tok, quantized, out, ArtifactManifest(base_model="demo")
    )


def test_gptq_w4a16_tp2_generates_the_tokens_of_one_process(tmp_path):
    _same_tokens_as_one_process(_gptq_artifact(tmp_path / "gptq", act_order=False), _prompts())


@pytest.mark.slow
def test_act_order_gptq_tp2_keeps_every_group_and_generates_the_same_tokens(tmp_path):
    path = _gptq_artifact(tmp_path / "gptq-act", act_order=True)
    _same_tokens_as_one_process(
        path, _prompts(4), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )


# -- each rank's slices, without processes ------------------------------------------------------


def _weight(m) -> torch.Tensor:
    from slimserve.runtime.layers.quant_linear import QuantLinear

    m = getattr(m, "inner", m)
    return m.dequantized_weight(torch.float32) if isinstance(m, QuantLinear) else m.weight.detach()


def _fused(parent, fused: str, parts: tuple[str, ...]) -> torch.Tensor:
    """The stacked weight of q/k/v (gate/up), fused at load or not (different g_idx)."""
    if hasattr(parent, fused):
        return _weight(getattr(parent, fused))
    return torch.cat([_weight(getattr(parent, p)) for p in parts])


def _rank_model(path, rank: int):
    """Rank `rank` of 2 as build_model makes it, less the communicating wrappers."""
    from types import SimpleNamespace

    from slimserve.runtime.distributed.loading import TensorShard
    from slimserve.runtime.models.load import build_model

    shard = TensorShard(SimpleNamespace(rank=rank, world=2))
    shard.parallelize = lambda model: None
    return build_model(path, torch.float32, torch.device("cpu"), verify="none", shard=shard).model


@pytest.mark.parametrize(
    "fmt,act_order,w8",
    [
        ("compressed-tensors", False, False),
        ("compressed-tensors", True, False),
        ("compressed-tensors", False, True),
        ("gptq", True, False),
        ("awq", False, False),
    ],
)
def test_rank_slices_of_quantized_formats_put_together_are_the_full_weights(
    tiny_checkpoint, tmp_path, fmt, act_order, w8
):
    """W4 groups of 64 (asymmetric: zero points packed along N), act-order, and W8A16 per channel
    (scales [N, 1]: split with the rows of column-parallel layers, whole on row-parallel ones)."""
    from slimserve.runtime.artifact.scheme import QuantArgs
    from slimserve.runtime.models.load import build_model

    args = QuantArgs(8, strategy="channel", group_size=None) if w8 else None
    path = _gptq_artifact(tmp_path / "a", act_order, fmt, base=tiny_checkpoint, args=args)
    full = build_model(path, torch.float32, torch.device("cpu"), verify="none").model
    from slimserve.runtime.layers.quant_linear import QuantLinear

    assert sum(isinstance(m, QuantLinear) for m in full.modules()) >= 2 * 4  # every decoder Linear
    ranks = [_rank_model(path, r) for r in range(2)]
    q, kv, inter = 128, 64, 256  # tiny Llama: 4 x 32 query, 2 x 32 KV, intermediate 256
    for i, layer in enumerate(full.model.layers):
        qkv = _fused(layer.self_attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
        gate_up = _fused(layer.mlp, "gate_up_proj", ("gate_proj", "up_proj"))
        for r, m in enumerate(ranks):
            mine = m.model.layers[i]
            want_qkv = torch.cat(
                [
                    qkv[r * q // 2 : (r + 1) * q // 2],
                    qkv[q + r * kv // 2 : q + (r + 1) * kv // 2],
                    qkv[q + kv + r * kv // 2 : q + kv + (r + 1) * kv // 2],
                ]
            )
            assert torch.equal(
                _fused(mine.self_attn, "qkv_proj", ("q_proj", "k_proj", "v_proj")), want_qkv
            )
            assert torch.equal(
                _weight(mine.self_attn.o_proj),
                _weight(layer.self_attn.o_proj)[:, r * q // 2 : (r + 1) * q // 2],
            )
            want_gu = torch.cat(
                [
                    gate_up[r * inter // 2 : (r + 1) * inter // 2],
                    gate_up[inter + r * inter // 2 : inter + (r + 1) * inter // 2],
                ]
            )
            assert torch.equal(_fused(mine.mlp, "gate_up_proj", ("gate_proj", "up_proj")), want_gu)
            assert torch.equal(
                _weight(mine.mlp.down_proj),
                _weight(layer.mlp.down_proj)[:, r * inter // 2 : (r + 1) * inter // 2],
            )
    v = -(-full.spec.vocab_size // 2)  # vocabulary rows per rank, the last shard zero-padded
    for r, m in enumerate(ranks):
        rows = full.model.embed_tokens.weight[r * v : (r + 1) * v]
        assert torch.equal(m.model.embed_tokens.weight[: rows.shape[0]], rows)
        assert torch.equal(
            m.lm_head.weight[: rows.shape[0]], full.lm_head.weight[r * v : (r + 1) * v]
        )


def test_a_batch_travels_as_one_header_and_one_int64_payload():
    from slimserve.runtime.batch import prepare_batch
    from slimserve.runtime.worker.rank_process import HEADER, pack_batch, unpack_batch

    batch = prepare_batch(
        [[5, 6, 7], [9]], [0, 20], [[3], [1, 4]], [True, True], 16, torch.device("cpu")
    )
    header, payload = pack_batch(batch)
    assert len(header) == HEADER.size and payload.dtype == torch.int64
    back = unpack_batch(HEADER.unpack(header), payload.clone())
    for name, want in vars(batch).items():
        got = getattr(back, name)
        assert (
            (torch.equal(got, want) and got.dtype == want.dtype)
            if isinstance(want, torch.Tensor)
            else got == want
        )


# -- sizes the model cannot take: refused before anything loads --------------------------------


def _demo_spec():
    from transformers import AutoConfig

    return model_spec(AutoConfig.from_pretrained(DEMO_MODEL))  # 6 heads, 2 KV heads, I = 1024


@pytest.mark.parametrize(
    "tp,qc,words",
    [
        (4, None, ["4", "num_attention_heads 6"]),
        (3, None, ["3", "2 KV heads"]),
        (
            2,
            {"quant_method": "gptq", "bits": 4, "group_size": 128},
            ["o_proj", "192", "group_size 128"],
        ),
    ],
)
def test_sizes_that_split_heads_gqa_or_quant_groups_are_refused(tp, qc, words):
    with pytest.raises(ValueError) as e:
        check_tensor_parallel(_demo_spec(), tp, qc)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value)
    check_tensor_parallel(_demo_spec(), 2, {"quant_method": "gptq", "bits": 4, "group_size": 64})


def test_cli_refuses_a_bad_size_with_one_line_and_exit_2():
    from slimserve.runtime.cli import app

    t0 = time.monotonic()
    r = CliRunner().invoke(
        app,
        ["generate", str(DEMO_MODEL), "-p", "x", "--device", "cpu", "--tensor-parallel-size", "4"],
    )
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "num_attention_heads 6" in lines[0]
    assert time.monotonic() - t0 < 30  # refused from config.json, no worker started
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model=str(DEMO_MODEL), tensor_parallel_size=0)
    r = CliRunner().invoke(
        app, ["generate", str(DEMO_MODEL), "-p", "x", "--device", "cpu", "-pp", "5"]
    )
    assert r.exit_code == 2 and "5 stages for 4 layers" in r.output, r.output
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(
            model=str(DEMO_MODEL), tensor_parallel_size=2, distributed_executor_backend="slurm"
        )


# -- per-rank memory and collective time: /metrics and runtime bench ---------------------------


def _rank_samples(text: str) -> dict[tuple[str, str], float]:
    """(sample name, rank) -> value of every series labelled `rank` in a /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, s.labels["rank"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if "rank" in s.labels
    }


GAUGES = (
    "slimserve:rank_weight_bytes",
    "slimserve:rank_kv_cache_bytes",
    "slimserve:rank_memory_bytes",
)
CALLS, SECONDS = "slimserve:tp_collective_calls_total", "slimserve:tp_collective_seconds_total"


def test_metrics_of_a_tp2_server_report_each_rank_and_the_collectives(demo_tp2):
    """Rank 1's numbers come from the worker itself: weight and KV bytes from its ready message,
    its RSS from /proc/<pid>/statm, its collective counters from what it publishes."""
    from fastapi.testclient import TestClient

    from slimserve.runtime.engine.async_engine import AsyncEngine
    from slimserve.runtime.server.app import build_app
    from slimserve.runtime.stats.rank_stats import rss_bytes
    from tests.helpers.live_server import wait_for

    runner = demo_tp2.engine.runner
    with TestClient(build_app(AsyncEngine(demo_tp2.engine))) as c:
        before = _rank_samples(c.get("/metrics").text)
        assert {rank for _, rank in before} == {"0", "1"}
        for name in GAUGES:
            assert before[(name, "0")] > 0 and before[(name, "1")] > 0, name
        assert before[("slimserve:rank_weight_bytes", "0")] == runner.weight_bytes
        assert before[("slimserve:rank_kv_cache_bytes", "0")] == runner.kv_cache_bytes
        # equal shards: the worker's own weight and KV bytes are rank 0's
        assert before[("slimserve:rank_weight_bytes", "1")] == runner.weight_bytes
        assert before[("slimserve:rank_kv_cache_bytes", "1")] == runner.kv_cache_bytes
        worker_rss = rss_bytes(runner.executor.procs[0].pid)
        assert 0.5 < before[("slimserve:rank_memory_bytes", "1")] / worker_rss < 2
        body = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        assert c.post("/v1/completions", json=body).status_code == 200
        after = _rank_samples(c.get("/metrics").text)
        # rank 0: at least 8 steps of 10 collectives each (2 per layer, embedding, logits gather)
        assert after[(CALLS, "0")] - before[(CALLS, "0")] >= 8 * 10
        assert after[(SECONDS, "0")] > before[(SECONDS, "0")]
        wait_for(
            lambda: (
                _rank_samples(c.get("/metrics").text)[(CALLS, "1")] - before[(CALLS, "1")] >= 8 * 10
            ),
            timeout=15,
            what="rank 1's published collective counters",
        )
        assert _rank_samples(c.get("/metrics").text)[(SECONDS, "1")] > before[(SECONDS, "1")]


def test_one_process_reports_rank_0_only_without_collectives():
    from slimserve.runtime.server.metrics import ServerMetrics
    from tests.helpers.server_fakes import FakeEngine

    samples = _rank_samples(ServerMetrics(FakeEngine()).render().decode())
    assert samples == {
        ("slimserve:rank_weight_bytes", "0"): 2**20,
        ("slimserve:rank_kv_cache_bytes", "0"): 2**19,
        ("slimserve:rank_memory_bytes", "0"): 2**26,
    }

    class Broken(FakeEngine):
        def rank_stats(self):
            raise RuntimeError("store closed")

    text = ServerMetrics(Broken()).render().decode()  # the scrape still renders, without them
    assert "slimserve:num_requests_running" in text and not _rank_samples(text)


BREAKDOWN_BEFORE = step_metrics(
    10, {"forward": 0.5, "sample": 0.1}, collectives={"0": (0.2, 100.0), "1": (7.0, 900.0)}
)
BREAKDOWN_AFTER = step_metrics(
    30, {"forward": 1.3, "sample": 0.3}, collectives={"0": (0.6, 300.0), "1": (9.0, 5000.0)}
)


def test_bench_breakdown_reports_rank_0s_collective_time_per_step():
    from rich.console import Console

    from slimserve.runtime.bench.breakdown import parse_step_totals, step_breakdown
    from slimserve.runtime.bench.report import format_breakdown

    b = step_breakdown(parse_step_totals(BREAKDOWN_BEFORE), parse_step_totals(BREAKDOWN_AFTER))
    assert b["steps"] == 20 and b["step_time_s"] == pytest.approx(1.0)
    c = b["collectives"]  # rank 0's counters only: rank 1's moved differently
    assert c["calls"] == 200 and c["calls_per_step"] == 10
    assert c["total_s"] == pytest.approx(0.4) and c["ms_per_step"] == pytest.approx(20.0)
    assert c["share"] == pytest.approx(0.4)
    console = Console(record=True, width=120)
    console.print(format_breakdown({"request_rate": 1.0, "step_breakdown": b}))
    out = console.export_text()
    assert "collectives, rank 0 (10/step; part of forward)" in out and "40.0%" in out
    one_process = BREAKDOWN_AFTER.split("# HELP slimserve:tp_collective_seconds")[0]
    assert (
        step_breakdown(parse_step_totals(one_process), parse_step_totals(one_process))[
            "collectives"
        ]
        is None
    )


# -- a worker that dies ------------------------------------------------------------------------


def test_a_killed_worker_fails_the_engine_with_its_rank_and_health_turns_503(demo_tp2):
    """Last in the module: it kills the shared engine's worker."""
    from fastapi.testclient import TestClient

    from slimserve.runtime.engine.async_engine import AsyncEngine
    from slimserve.runtime.server.app import build_app

    executor = demo_tp2.engine.runner.executor
    with TestClient(build_app(AsyncEngine(demo_tp2.engine))) as c:
        body = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}
        assert c.post("/v1/completions", json=body).status_code == 200
        assert c.get("/health").status_code == 200
        worker = executor.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        t0 = time.monotonic()
        r = c.post("/v1/completions", json=body)
        assert r.status_code >= 500 and time.monotonic() - t0 < 30  # an error, not a hang
        h = c.get("/health")
        assert h.status_code == 503 and "rank 1" in h.json()["error"]["message"]
        m = c.get("/metrics")  # the dead worker's rows are gone; the scrape still answers
        assert m.status_code == 200 and {rank for _, rank in _rank_samples(m.text)} == {"0"}
    demo_tp2.engine.output_deltas = False
    with pytest.raises(WorkerDiedError, match="rank 1"):  # the offline API: the same error
        demo_tp2.generate("x = [", SamplingParams(max_tokens=4), use_tqdm=False)


# -- the ray executor (optional extra): the same worker code as Ray actors ---------------------


@pytest.mark.slow  # a local Ray cluster starts in ~15 s on a loaded 2-core machine
def test_ray_executor_gives_the_same_tokens_and_names_a_killed_actor(demo_reference):
    ray = pytest.importorskip("ray")
    prompts, one = demo_reference
    try:
        tp = LLM(
            str(DEMO_MODEL), **ENGINE, tensor_parallel_size=2, distributed_executor_backend="ray"
        )
        try:
            _compare(one, _tokens(tp, prompts), GREEDY)
        finally:
            tp.shutdown()
        few = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        pp = LLM(
            str(DEMO_MODEL), **ENGINE, pipeline_parallel_size=2, distributed_executor_backend="ray"
        )
        try:
            _compare([t[:16] for t in one[:4]], _tokens(pp, prompts[:4], few), few)
            ray.kill(pp.engine.runner.executor.actors[0])
            with pytest.raises(WorkerDiedError, match="rank 1"):
                pp.generate("x = [", few, use_tqdm=False)
        finally:
            pp.shutdown()
    finally:
        ray.shutdown()


# -- listening sockets: a single-host TP server exposes nothing but its API port -------------------


def _pid_tree(pid: int) -> set[int]:
    """`pid` and every process below it (from /proc/<pid>/task/*/children)."""
    from pathlib import Path

    seen, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return seen


def _listening(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state held by `pids`; addresses as the
    kernel gives them, decoded (IPv4 dotted, IPv6 as 32 hex digits)."""
    import socket as socketlib
    from pathlib import Path

    inodes = set()
    for p in pids:
        for fd in Path(f"/proc/{p}/fd").glob("*"):
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: TCP_LISTEN
                continue
            addr, port = f[1].split(":")
            if len(addr) == 8:
                addr = socketlib.inet_ntop(socketlib.AF_INET, bytes.fromhex(addr)[::-1])
            out.append((addr, int(port, 16)))
    return out


def _loopback(addr: str) -> bool:
    if "." in addr:
        return addr.startswith("127.")
    words = [addr[i : i + 8] for i in range(0, 32, 8)]  # four little-endian 32-bit words
    v6 = b"".join(bytes.fromhex(w)[::-1] for w in words)
    return v6 == bytes(15) + b"\x01" or (v6[:12] == bytes(10) + b"\xff\xff" and v6[12] == 127)


def test_a_single_host_tp2_server_listens_on_nothing_but_its_api_port(tmp_path):
    """The rendezvous store and gloo's sockets are bound to loopback (runtime/distributed/
    group.py): served on every interface, the API port is the only socket others can reach."""
    import subprocess
    import sys

    import httpx

    from slimserve.runtime.server.process import free_port

    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slimserve.runtime.cli",
            "serve",
            str(DEMO_MODEL),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "16MiB",
            "--tensor-parallel-size",
            "2",
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the TP=2 server did not come up"
            try:
                if (
                    httpx.get(
                        f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False
                    ).status_code
                    == 200
                ):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            trust_env=False,
            timeout=60,
            json={"prompt": "hello", "max_tokens": 4},
        )  # the ranks have talked
        assert r.status_code == 200, r.text
        pids = _pid_tree(proc.pid)
        assert len(pids) >= 2  # the server and its rank-1 worker
        sockets = _listening(pids)
        exposed = {(a, p) for a, p in sockets if not _loopback(a)}
        assert {p for _, p in exposed} == {port}, sockets
        assert any(_loopback(a) for a, _ in sockets), sockets  # the store: there, on loopback
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
