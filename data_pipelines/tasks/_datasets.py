"""lm-eval's `!function _datasets.task_dataset` target: lm-eval resolves it relative to the YAML's folder."""
from data_pipelines.downstream import task_dataset

__all__ = ["task_dataset"]
