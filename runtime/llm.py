"""Offline batched generation, shaped like vLLM's: `LLM(artifact).generate(prompts, params)`."""

from __future__ import annotations

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.engine.llm_engine import LLMEngine
from slimserve.runtime.engine.sequence import RequestOutput, SamplingParams


class LLM:
    """Load an artifact (or HF checkpoint folder, or GGUF checkpoint: a .gguf file, a folder holding
    one, `pkg:<module>`; runtime/loading/gguf.py) once and generate for many prompts at a time.

    Keyword arguments are EngineConfig fields (max_num_seqs, kv_cache_memory, device,
    tensor_parallel_size, ...);
    `verify="none"` loads a slimserve artifact whose slimserve.json is missing or mismatched
    (default "strict": refused; plain HF checkpoints load either way).
    """

    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        self._ids = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes now (they also stop when this process exits)."""
        stop = getattr(self.engine.runner, "shutdown", None)
        if stop is not None:
            stop()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Final outputs in the order of `prompts` (token-id lists are taken as they are)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        order = []
        for prompt, p in zip(prompts, params):  # validate every prompt before running any
            order.append(self.engine.make_sequence(f"offline-{self._ids}", prompt, p))
            self._ids += 1
        for seq in order:
            self.engine.add_sequence(seq)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(order), desc="generate", unit="req", dynamic_ncols=True)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[s.request_id] for s in order]
