"""Synthetic recall and copying tasks, their training loop, and the ``posattn compare`` sweep."""
from posattn.synthetic.generators import IGNORE, TASK_PARAMS, TASKS, TaskData, TaskError, generate
from posattn.synthetic.train import TrainConfig, TrainResult, evaluate, train

__all__ = ["IGNORE", "TASK_PARAMS", "TASKS", "TaskData", "TaskError", "generate", "TrainConfig", "TrainResult",
           "evaluate", "train"]
