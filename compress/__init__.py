"""slimserve: compress, evaluate and export Hugging Face causal LMs."""
