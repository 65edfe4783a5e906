"""The step loop: `LLMEngine` (llm_engine.py) schedules sequences (scheduler.py) over the paged
KV cache's blocks (block_manager.py, prefix caching), runs one batch per step through the
model runner (runtime/worker/), samples (sampler.py), applies stop rules (stops.py) and
detokenizes incrementally (detokenizer.py); `AsyncEngine` (async_engine.py) is the server's
front: one engine thread, per-request queues. Requests are `Sequence`s (sequence.py)."""
