"""Tensor- and pipeline-parallel serving: one model split over several processes (issue 15).

`group.py` sets up the communicator of the N ranks and times its collectives; `sharding.py`
holds the Megatron-style rules (which tensor is split along which dimension, the checks that
refuse a size before anything loads) and reads each rank's slices from the safetensors;
`layers.py` holds the parallel layers that wrap a loaded model's Linears and embedding;
`pipeline.py` holds the pipeline stages (layer ranges, micro-batches, point-to-point sends);
`executor.py` starts the worker processes and sends each step's batch (`ray_executor.py`: the
same with Ray actors, for several nodes); `worker.py` is their loop; `rank_stats.py` holds what
each rank reports for /metrics (memory, collective time). The engine sees none of it:
`ModelRunner` (runtime/model_runner.py) is rank 0.
"""
