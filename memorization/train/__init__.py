"""The training command: the run's plan, data preparation, the run pipeline and the dry run."""
