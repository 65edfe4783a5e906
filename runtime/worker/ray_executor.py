"""The `ray` executor: ranks 1..N-1 as Ray actors, one per GPU (or per CPU share), on any node.

`pip install -e ".[ray]"`. The driver joins the Ray cluster named by `RAY_ADDRESS` (or starts a
local one), reserves one bundle per rank in a placement group (`{"GPU": 1}` on CUDA, `{"CPU":
cores / N}` on CPU; rank 0's bundle is the driver's own share) and starts one actor per other
rank in its bundle. Each actor runs the same worker code as the `mp` executor
(`worker_main`, runtime/worker/rank_process.py); what differs is the transport: rank 0's TCPStore
listens on this node's address (the one Ray reports, `ray.util.get_node_ip_address`; only
there, not on every interface: the address given to `ray start --node-ip-address`) and each
actor's gloo sockets on its own node's, the step headers and the workers' messages travel
through it (`StoreChannel`) instead of pipes, signed with the run's secret
(runtime/distributed/signed_store.py: a value written by anything without it is refused), and a
worker's liveness is its actor's. Ray gives each actor
its one GPU as cuda:0.

/metrics: an actor may run on another node, so the driver reads no /proc of its own here: each
worker's process memory (its RSS on CPU, its allocated CUDA memory on GPUs) is the value the
worker publishes in the store (runtime/stats/rank_stats.py), at most about a second old.
"""

from __future__ import annotations

import json
import time

import torch

from slimserve.runtime.worker.executor import MultiprocExecutor
from slimserve.runtime.worker.rank_process import worker_main


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError(
            "distributed_executor_backend: 'ray' needs Ray; pip install -e \".[ray]\" "
            "(or use the default 'mp' on one machine)"
        ) from None
    return ray


class RayWorker:
    """One rank, as a Ray actor."""

    def run(self, rank, world, host, port, config, threads, cuda, secret):
        import ray

        worker_main(
            rank,
            world,
            port,
            config,
            None,
            threads,
            host=host,
            cuda_index=0 if cuda else None,
            bind=ray.util.get_node_ip_address(),
            secret=secret,
        )


class RayExecutor(MultiprocExecutor):
    name = "ray"

    def _bind_address(self) -> str:
        """This node's address as Ray knows it (so Ray is joined first: before that,
        `get_node_ip_address` guesses from the default route, not `--node-ip-address`); the
        actors on other nodes connect there."""
        ray = _ray()
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
        return ray.util.get_node_ip_address()

    def _start_workers(self, config, store) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray, self.store, self.steps = ray, self.signed, 0  # every value signed
        cuda = self.device.type == "cuda"
        bundle = {"GPU": 1} if cuda else {"CPU": self.threads or 1}
        self.pg = placement_group([bundle] * self.world, strategy="PACK")
        ray.get(self.pg.ready(), timeout=120)
        actor = ray.remote(num_gpus=1 if cuda else 0, num_cpus=0 if cuda else (self.threads or 1))(
            RayWorker
        )
        self.actors, self.runs, self._seen = [], [], {}
        for rank in range(1, self.world):
            a = actor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=rank
                )
            ).remote()
            self.actors.append(a)
            self.runs.append(
                a.run.remote(
                    rank, self.world, self.bind, store.port, config, self.threads, cuda, self.secret
                )
            )

    def _post(self, header: bytes) -> None:
        self.store.set(f"step/{self.steps}", header)  # one write, read by every worker
        if self.steps:
            # every worker has read it: it ran that step
            self.store.delete_key(f"step/{self.steps - 1}")
        self.steps += 1

    def _messages(self, rank: int, wait_s: float = 0.0) -> list[tuple[str, str]]:
        deadline, out = time.monotonic() + wait_s, []
        while True:
            i = self._seen.get(rank, 0)
            key = f"msg/{rank}/{i}"
            if self.store.check([key]):
                kind, payload = json.loads(self.store.get(key))  # (kind, str or dict): never pickle
                out.append((kind, payload))
                self._seen[rank] = i + 1
                continue
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(0.01)

    def _exit_status(self, rank: int) -> tuple[bool, str]:
        run = self.runs[rank - 1]
        done, _ = self._ray.wait([run], timeout=0)
        if not done:
            return False, ""
        try:
            self._ray.get(run)
            how = "its actor returned"
        except Exception as e:  # noqa: BLE001 (an actor that died: Ray says how)
            how = f"actor died: {type(e).__name__}"
        return True, how

    def _worker_memory(self, rank: int, published: dict) -> int | None:
        return None  # the actor's own published value (it may run on another node)

    def _stop_workers(self, stop: bytes) -> None:
        try:
            self.store.set(f"step/{self.steps}", stop)
        except RuntimeError:
            pass
        try:
            self._ray.wait(self.runs, num_returns=len(self.runs), timeout=5)
        finally:
            for a in self.actors:
                self._ray.kill(a)
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)


def make_executor(config, device: torch.device) -> MultiprocExecutor:
    """The executor `config.distributed_executor_backend` names."""
    return (
        RayExecutor(config, device)
        if config.distributed_executor_backend == "ray"
        else MultiprocExecutor(config, device)
    )
