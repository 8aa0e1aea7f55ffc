"""Model runners of the serving engine: the HF forward, the fused Llama runner, CUDA graphs, adapter slots."""
