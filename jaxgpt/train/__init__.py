"""Training: pure jitted steps (optax), tasks (batches as functions of the step), orbax
checkpoints and the loop behind ``jaxgpt train``."""
from jaxgpt.train.losses import cross_entropy, loss_terms
from jaxgpt.train.optim import make_optimizer, schedule
from jaxgpt.train.step import (TrainState, abstract_state, init_state, make_eval_step, make_train_step,
                               make_train_steps)

__all__ = ["TrainState", "abstract_state", "cross_entropy", "init_state", "loss_terms", "make_eval_step",
           "make_optimizer", "make_train_step", "make_train_steps", "schedule"]
