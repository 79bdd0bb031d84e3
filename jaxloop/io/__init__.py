"""Reading and writing models and runs: HF safetensors, orbax items, the run directory layout."""
