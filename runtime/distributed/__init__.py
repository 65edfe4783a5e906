"""Tensor- and pipeline-parallel serving: what the ranks of one model share below the model
runner (issue 15).

`group.py` sets up the communicator of the N ranks (its sockets bound to loopback on one host)
and times its collectives; `sharding.py` holds the Megatron-style rules (which tensor is split
along which dimension, the checks that refuse a size before anything loads) and reads each
rank's slices from the safetensors; `loading.py` loads a rank's slices into a model; `layers.py`
holds the parallel layers that wrap a loaded model's Linears and embedding; `pipeline.py` holds
the pipeline stages (layer ranges, micro-batches, point-to-point sends); `signed_store.py` signs
what the ranks say through the group's store. The executors that start the ranks, and each
rank's loop, sit above the runner in runtime/worker/. The engine sees none of it: `ModelRunner`
(runtime/worker/model_runner.py) is rank 0.
"""
