"""Training: typed config (``TrainConfig``), named experiments, the trainer (``train(cfg) -> run folder``), cooldown
branches of a stable run (``branch(run_dir, at_step, cooldown_steps) -> branch folder``)."""

from . import experiments as experiments
from .config import (DataSection as DataSection, DeoscSection as DeoscSection, LogSection as LogSection,
                     ModelSection as ModelSection, OptimSection as OptimSection, ParallelSection as ParallelSection,
                     ScheduleSection as ScheduleSection, TrainConfig as TrainConfig, TrainSection as TrainSection,
                     apply_overrides as apply_overrides)
from .evaluation import evaluate as evaluate
from .trainer import (Interrupted as Interrupted, NonFiniteLoss as NonFiniteLoss, Trainer as Trainer,
                      lr_at as lr_at, train as train)
from .branch import branch as branch, branch_fit as branch_fit
