"""Tensor-parallel layers of the 3D engine (linear, embedding, vocab-parallel cross-entropy)."""
from axonn.layers.cross_entropy import VocabShardedLogits, cross_entropy, gather_logits, token_cross_entropy
from axonn.layers.embedding import ParallelEmbedding
from axonn.layers.layout import ParamSpec, spec_of
from axonn.layers.linear import ParallelLinear

__all__ = ["ParallelLinear", "ParallelEmbedding", "ParamSpec", "spec_of", "VocabShardedLogits",
           "cross_entropy", "gather_logits", "token_cross_entropy"]
