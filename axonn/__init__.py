"""AxoNN-style 4D engine: 3D tensor-parallel layers (X, Y, Z) plus data parallelism on torch.distributed."""
from axonn.comm import Comm, CommStats
from axonn.config import ConfigError
from axonn.engine import all_reduce_sum, batch_shard, clip_grad_norm_, grad_norm, shard_batch, sync_gradients
from axonn.grid import ProcessGrid, init, launch_env, parse_grid, validate_grid_for_model
from axonn.layers import (ParallelEmbedding, ParallelLinear, ParamSpec, VocabShardedLogits, cross_entropy,
                          gather_logits, spec_of)
from axonn.parallelize import parallelize
from axonn.state import full_grad_dict, full_state_dict, load_pretrained, save_pretrained, serial_copy

__all__ = [
    "ConfigError", "ProcessGrid", "init", "launch_env", "parse_grid", "validate_grid_for_model",
    "parallelize", "full_state_dict", "full_grad_dict", "load_pretrained", "save_pretrained",
    "serial_copy", "cross_entropy",
    "gather_logits", "all_reduce_sum", "sync_gradients", "clip_grad_norm_", "grad_norm",
    "batch_shard", "shard_batch", "Comm", "CommStats", "ParallelLinear", "ParallelEmbedding",
    "ParamSpec", "VocabShardedLogits", "spec_of",
]
