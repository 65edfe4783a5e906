"""Prefill/decode disaggregation: a prefill replica computes a prompt's KV (and its first token)
and hands the KV blocks to a decode replica that generates the rest (`runtime serve --role`).

- `layout.py`: what both sides must agree on (KV dtype, block size, KV heads, head dim, layers,
  FP8 k/v scales of any shape), checked on import;
- `segment.py`: the shared-memory segment format (/dev/shm files: a JSON header, then the
  blocks' raw bytes), the names, and the expiry of segments nobody imported;
- `transfer.py`: the engine hooks: export a finished prefill's blocks into a segment, read and
  check a segment, scatter its blocks into the decode engine's cache;
- `protocol.py`: the HTTP side (the headers the router and the servers exchange).
"""
