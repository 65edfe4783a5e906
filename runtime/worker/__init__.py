"""What runs the model for the engine: `ModelRunner` (model_runner.py: the KV cache, the
forward, CUDA graphs in cuda_graphs.py, the CPU allocator setting in cpu_malloc.py) and the
executors that start the other ranks of a tensor/pipeline-parallel model and sit above the
runner (executor.py: spawned processes; ray_executor.py: Ray actors; rank_process.py: a rank's
loop; launch.py: the engine's runner, one process or rank 0 and its executor). What the ranks
share below the runner lives in runtime/distributed/."""
