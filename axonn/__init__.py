"""AxoNN-style 4D engine: 3D tensor-parallel layers (X, Y, Z) plus data parallelism on torch.distributed.

Names are resolved lazily (PEP 562), for a measured reason: importing a submodule imports this
package first, and `axonn.plan` (the planner, `axonn-plan`, every dry run) and `axonn.config` are
pure Python that import in 0.05 s, while the engine needs torch and transformers (2.6 s on the
2-core CI machine, `python -X importtime`). Eager exports here would charge those 2.6 s to every
planner call and every config error.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ConfigError": "memorize_core",
    "Comm": "axonn.comm", "CommStats": "axonn.comm",
    "all_reduce_sum": "axonn.engine", "batch_shard": "axonn.engine", "clip_grad_norm_": "axonn.engine",
    "grad_norm": "axonn.engine", "shard_batch": "axonn.engine", "sync_gradients": "axonn.engine",
    "no_sync": "axonn.engine", "EngineOptions": "axonn.schedule",
    "ProcessGrid": "axonn.grid", "init": "axonn.grid", "parse_grid": "axonn.grid",
    "validate_grid_for_model": "axonn.grid", "launch_env": "axonn.launch",
    "ParallelEmbedding": "axonn.layers", "ParallelLinear": "axonn.layers", "ParamSpec": "axonn.layers",
    "VocabShardedLogits": "axonn.layers", "cross_entropy": "axonn.layers", "gather_logits": "axonn.layers",
    "token_cross_entropy": "axonn.layers",
    "parallelize": "axonn.swap", "is_parallel": "axonn.engine",
    "ParallelPlan": "axonn.parallel_plan", "plan_for": "axonn.parallel_plan",
    "EngineHandle": "axonn.engine", "engine_of": "axonn.engine", "layouts_of": "axonn.engine",
    "full_grad_dict": "axonn.state", "full_state_dict": "axonn.state", "load_pretrained": "axonn.state",
    "save_pretrained": "axonn.state",
    "Trainer": "axonn.trainer", "TrainerConfig": "axonn.config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'axonn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
