"""The model: a Llama-style decoder, dense or with a mixture of experts (``llama``). It calls linear layers and
knows nothing of their quantization beyond that (``convert`` replaces its ``nn.Linear`` layers from outside)."""

from .llama import SIZES, Block, Llama, ModelConfig, MoEFeedForward, apply_rope, rope_tables, size_names

__all__ = ["ModelConfig", "Llama", "Block", "MoEFeedForward", "SIZES", "size_names", "rope_tables", "apply_rope"]
