"""Reading checkpoints: the transformers-based loader of artifacts and HF checkpoints
(loader.py), layer-at-a-time skeletons and positioned safetensors reads (lazy_weights.py),
GGUF files dequantized once into a cached HF folder (gguf.py), and FP8 KV-cache attention for
transformers models (hf_fp8kv.py). Our engine's own model building is runtime/models/."""
