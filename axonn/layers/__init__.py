"""Tensor-parallel layers of the 3D engine (linear, embedding, vocab-parallel cross-entropy)."""
from axonn.layers.functions import VocabShardedLogits, cross_entropy, gather_logits, token_cross_entropy
from axonn.layers.layout import ParamSpec
from axonn.layers.modules import ParallelEmbedding, ParallelLinear

__all__ = ["ParallelLinear", "ParallelEmbedding", "ParamSpec", "VocabShardedLogits",
           "cross_entropy", "gather_logits", "token_cross_entropy"]
