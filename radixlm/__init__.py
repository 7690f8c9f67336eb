"""radixlm: a small LLM serving runtime (RadixAttention, continuous batching, structured generation)."""
__version__ = "0.1.0"
