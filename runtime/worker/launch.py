"""The engine's runner: one process, or rank 0 of a tensor/pipeline-parallel model.

`make_runner(config)` is what `LLMEngine` calls. With `tensor_parallel_size` N and
`pipeline_parallel_size` M both 1 it is a plain `ModelRunner`. Otherwise it refuses, from
config.json alone and before any process starts, a size the model cannot take
(runtime/distributed/sharding.py, runtime/distributed/pipeline.py), starts ranks 1..N x M - 1
through the executor the config names (`mp`: runtime/worker/executor.py, `ray`:
runtime/worker/ray_executor.py), builds rank 0's runner on the executor's group, and waits
until every rank has loaded its shard. A failure on any rank stops the others and is raised
naming the rank.

It lives here, above runtime/worker/model_runner.py, so that the runner never imports the executor:
the executor starts workers (runtime/worker/rank_process.py) that build runners themselves.
"""

from __future__ import annotations

from pathlib import Path

import torch

from slimserve.runtime.artifact.importers import read_quant_config
from slimserve.runtime.config import EngineConfig
from slimserve.runtime.devices import resolve_device
from slimserve.runtime.distributed.pipeline import stage_layers
from slimserve.runtime.distributed.sharding import check_tensor_parallel
from slimserve.runtime.models.arch import model_spec
from slimserve.runtime.worker.model_runner import ModelRunner
from slimserve.runtime.worker.ray_executor import make_executor


def make_runner(config: EngineConfig) -> ModelRunner:
    """A ModelRunner for `config`; rank 0 holding the executor of the other ranks when split."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if tp * pp == 1:
        return ModelRunner(config)
    check_sizes(config, tp, pp)
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", 0)  # rank r runs on cuda:r (Ray: each actor's own cuda:0)
    executor = make_executor(config, device)
    try:
        runner = ModelRunner(config, group=executor.group, executor=executor)
    except BaseException as e:
        err = executor.failure(e)  # a worker's own error, naming its rank, explains it best
        executor.shutdown()
        if err is e:
            raise
        raise err from None
    executor.wait_ready()
    return runner


def check_sizes(config: EngineConfig, tp: int, pp: int) -> None:
    """Refuse a tensor- or pipeline-parallel size the model cannot take, from config.json alone."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
    spec = model_spec(hf)
    check_tensor_parallel(spec, tp, read_quant_config(Path(config.model)))
    if pp > 1:
        stage_layers(spec.num_layers, pp)
