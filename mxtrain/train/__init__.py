"""Training: typed config (``TrainConfig``), named experiments, the trainer (``train(cfg) -> run folder``), cooldown
branches of a stable run (``branch(run_dir, at_step, cooldown_steps) -> branch folder``), torchrun / DDP / FSDP2 /
DCP checkpoints for the trainer and for a loop of one's own (``parallel``), weight de-oscillation (``deosc``:
``Deoscillator``, ``DeoscSettings``, ``DeoscCallback``)."""

from . import deosc as deosc, experiments as experiments, parallel as parallel
from .config import (DataSection as DataSection, DeoscSection as DeoscSection, LogSection as LogSection,
                     ModelSection as ModelSection, OptimSection as OptimSection, ParallelSection as ParallelSection,
                     ScheduleSection as ScheduleSection, TrainConfig as TrainConfig, TrainSection as TrainSection,
                     apply_overrides as apply_overrides)
from .deosc import DeoscCallback as DeoscCallback, DeoscSettings as DeoscSettings, Deoscillator as Deoscillator
from .evaluation import evaluate as evaluate
from .trainer import (Interrupted as Interrupted, NonFiniteLoss as NonFiniteLoss, Trainer as Trainer,
                      lr_at as lr_at, train as train)
from .branch import branch as branch, branch_fit as branch_fit
