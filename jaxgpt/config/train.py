"""TrainConfig: optimisation, data and run settings shared by jaxgpt.train and torch_ref.train."""
from __future__ import annotations

import math
from dataclasses import dataclass

from jaxgpt.config.base import _Config, _choice, _positive, _probability
from jaxgpt.config.execution import Execution

SCHEDULES = ("cosine", "constant")
DECAY = ("all", "linear", "matrices")
TOKENIZERS = ("char", "bpe")
ON_NONFINITE = ("stop", "skip")
DATA_ORDERS = ("random", "epochs")
DOCUMENTS = ("stream", "masked", "isolated")  # jaxgpt.data.documents
MAX_STEPS_PER_CALL = 64  # 'auto' steps_per_call: the batches of one call are stacked on the device
# ``jaxgpt train --init`` (fine-tuning) over TrainConfig's defaults: weight decay on matrices only, as HF
# Trainer and nanoGPT group it, and a warmup of ``init_warmup`` updates (results/defaults/).
INIT_DEFAULTS = {"decay": "matrices"}
INIT_WARMUP_FRACTION, INIT_WARMUP_MAX = 0.05, 100


@dataclass(frozen=True)
class TrainConfig(_Config):
    """Optimisation and data settings, shared by jaxgpt.train and torch_ref.train.

    Defaults are seed 000's: AdamW(lr 3e-4, betas (0.9, 0.95), weight decay 0.1 on every
    parameter), no warmup, cosine annealing to 0.1 * lr, gradient clipping at 1.0, batches of 32 x 64.
    ``jaxgpt train`` starts some runs from other values: the GPT-2 presets decay matrices only
    (``jaxgpt.config.presets.train_defaults``), and ``--init`` fine-tuning decays matrices only and warms
    up (``INIT_DEFAULTS``, ``init_warmup``).
    """

    steps: int = 500
    batch_size: int = 32  # sequences per optimizer step (split into grad_accum micro-batches)
    seq_len: int = 64  # LM window; pair and classification data: padded sequence length
    grad_accum: int = 1
    lr: float = 3e-4
    schedule: str = "cosine"  # 'cosine': linear warmup, then cosine to lr * min_lr_ratio; 'constant'
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # 'all': every parameter (the seeds, torch AdamW); 'linear': Linear kernels (and MoE expert weights) only;
    # 'matrices': those and embeddings, not norms or biases (nanoGPT's "every >= 2-D parameter")
    decay: str = "all"
    grad_clip: float | None = 1.0  # global-norm clip; None = off
    seed: int = 0  # init, batch order and dropout all derive from it
    # Language-model data (text and token files): 'random' draws each window start uniformly, with replacement
    # (nanoGPT's get_batch); 'epochs' reads every window of seq_len + 1 tokens once an epoch, shuffled per
    # (seed, epoch) (jaxgpt.data.order). Pair and classification data always read each row once an epoch.
    data_order: str = "random"
    # Documents in a language-model window (jaxgpt.data.documents; token directories record an EOS after each):
    # 'stream' attends across them (nanoGPT); 'masked' keeps attention inside each document (segment ids);
    # 'isolated' also restarts positions at each document, so each is computed as if alone in its row.
    documents: str = "stream"
    tokenizer: str = "char"  # text files: 'char' (sorted characters) or 'bpe' (trained locally)
    bpe_vocab: int = 1024
    # The validation split: the fraction of the data held out for evaluation where train splits the data
    # itself (text files, .tsv rows, built-in corpora). A token directory comes split by jaxgpt prepare (its
    # --val-fraction / --min-val-tokens) and evaluates on its val.bin. 0: no validation split and no evaluation.
    val_fraction: float = 0.1
    # Epoch-based runs: epochs > 0 makes the run epochs passes over the training data; steps and
    # steps_per_epoch are then derived from the data (jaxgpt.data.tasks.with_epochs; jaxgpt train does it).
    epochs: int = 0
    steps_per_epoch: int = 0  # set by with_epochs; 0 = unknown
    lr_per_epoch: bool = False  # the schedule advances once per epoch (CosineAnnealingLR(T_max=epochs), seed 002)
    eval_every: int = 100  # 0 = only at the end
    eval_batches: int = 10
    log_every: int = 10
    ckpt_every: int = 100  # 0 = only at the end
    keep: int = 3  # checkpoints kept on disk (plus the newest until it has been read back intact)
    # A NaN/inf loss or gradient norm: 'stop' (error naming the step, nothing saved after it) or 'skip' (the
    # jitted step keeps the old params and optimizer state; the batch is consumed, metrics count it).
    on_nonfinite: str = "stop"
    # Engine knob (jaxgpt.parallel.sharding): device mesh 'data=N,fsdp=M,tensor=K' ('' = one device). It changes
    # placement, not the math; a run may resume on another mesh. batch_size / grad_accum must divide by data*fsdp*expert.
    # 'auto': on a CPU host, the micro-batch split over its CPU devices (jaxgpt.parallel.host_devices), else one device.
    mesh: str = "auto"
    # Engine knobs of the model (jaxgpt.config.execution): kernels, layer scan, remat, matmul precision. Like the
    # mesh they change no number; a run may resume under another Execution (the params' layout is converted).
    # None: Execution.for_model(config), the default for the model trained.
    execution: Execution | None = None
    # Engine knob (jaxgpt.train.step.make_train_steps): updates per call of the jitted program ``fit`` runs,
    # a loop inside the program over that many batches; the same updates, fewer host round trips. 'auto':
    # log_every, at most MAX_STEPS_PER_CALL (a call ends where fit logs, evaluates or saves anyway); 1: one
    # dispatch per update.
    steps_per_call: int | str = "auto"
    # Mixture-of-Experts models (ModelConfig.moe) add coef * loss to the training objective, averaged over
    # tokens like the cross entropy: the load-balancing loss (Switch / transformers' load_balancing_loss_func)
    # and the ST-MoE router z-loss (0: off). router_aux_coef None: the model's moe.aux_loss_coef (an HF
    # checkpoint's router_aux_loss_coef, e.g. 0.001 for Mixtral); a number overrides it for this run.
    router_aux_coef: float | None = None
    router_z_coef: float = 0.0

    def _validate(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_batches", "log_every", "keep"):
            _positive(name, getattr(self, name))
        k = self.steps_per_call
        if k != "auto" and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"steps_per_call must be 'auto' or an int >= 1, got {k!r}")
        for name in ("warmup_steps", "eval_every", "ckpt_every", "seed", "epochs", "steps_per_epoch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}")
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("decay", self.decay, DECAY)
        _choice("tokenizer", self.tokenizer, TOKENIZERS)
        _choice("on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        _choice("data_order", self.data_order, DATA_ORDERS)
        _choice("documents", self.documents, DOCUMENTS)
        if self.bpe_vocab < 257:
            raise ValueError(f"bpe_vocab must be >= 257 (256 byte tokens + merges), got {self.bpe_vocab!r}")
        if self.warmup_steps >= self.steps and self.schedule == "cosine" and self.warmup_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be < steps={self.steps}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        _probability("beta1", self.beta1)
        _probability("beta2", self.beta2)
        if (self.router_aux_coef or 0.0) < 0 or self.router_z_coef < 0:
            raise ValueError(f"router_aux_coef and router_z_coef must be >= 0, got {self.router_aux_coef!r}, "
                             f"{self.router_z_coef!r}")
        if self.weight_decay < 0 or self.eps <= 0:
            raise ValueError(f"need weight_decay >= 0 and eps > 0, got {self.weight_decay!r}, {self.eps!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction!r}")
        if self.lr_per_epoch and not self.epochs:
            raise ValueError("lr_per_epoch=True steps the schedule once per epoch: it needs epochs > 0")
        if self.steps_per_epoch and self.epochs and self.steps != self.epochs * self.steps_per_epoch:
            raise ValueError(f"steps={self.steps} is not epochs * steps_per_epoch = {self.epochs} * "
                             f"{self.steps_per_epoch}; derive them with jaxgpt.data.tasks.with_epochs")
        if self.mesh and self.mesh != "auto":
            from jaxgpt.config.mesh import batch_devices, parse_mesh

            n = batch_devices(parse_mesh(self.mesh))
            if self.micro_batch % n:
                raise ValueError(f"mesh={self.mesh!r} splits each micro-batch over data*fsdp*expert="
                                 f"{n} devices, but batch_size/grad_accum="
                                 f"{self.micro_batch} is not a multiple of it")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        if isinstance(d.get("execution"), dict):
            d = {**d, "execution": Execution.from_dict(d["execution"])}
        return super().from_dict(d)

    def aux_coef(self, config) -> float:
        """The load-balancing loss coefficient for a MoE ``config``: router_aux_coef, or the model's own."""
        return config.moe.aux_loss_coef if self.router_aux_coef is None else self.router_aux_coef

    @property
    def updates_per_call(self) -> int:
        """``steps_per_call`` resolved: 'auto' -> min(log_every, MAX_STEPS_PER_CALL)."""
        return min(self.log_every, MAX_STEPS_PER_CALL) if self.steps_per_call == "auto" else self.steps_per_call

    @property
    def micro_batch(self) -> int:
        return self.batch_size // self.grad_accum

    @property
    def schedule_units(self) -> tuple[int, int]:
        """(updates per schedule step, schedule steps in the run): (1, steps), or with lr_per_epoch
        (steps_per_epoch, epochs)."""
        if self.lr_per_epoch:
            if not self.steps_per_epoch:
                raise ValueError("lr_per_epoch needs steps_per_epoch: derive it with jaxgpt.data.tasks.with_epochs")
            return self.steps_per_epoch, self.epochs
        return 1, self.steps

    def lr_at(self, step, xp=None):
        """Learning rate of update ``step`` (0-based): linear warmup over ``warmup_steps`` (reaching
        lr at step warmup_steps - 1), then cosine from lr to lr * min_lr_ratio at ``steps``. With
        lr_per_epoch the unit is the epoch: update ``step`` uses epoch step // steps_per_epoch, and
        warmup_steps counts epochs.

        The one copy of the formula. ``xp``: the array module to evaluate it in: ``jax.numpy`` for a
        traced update count (jaxgpt.train.optim.schedule, the optax schedule) or ``numpy``; None:
        Python floats (torch_ref.train's LambdaLR)."""
        if self.schedule == "constant":
            return self.lr
        per, total = self.schedule_units
        step = step // per
        w, floor = self.warmup_steps, self.lr * self.min_lr_ratio
        clip = (lambda x, lo, hi: min(max(x, lo), hi)) if xp is None else xp.clip
        cos = math.cos if xp is None else xp.cos
        progress = clip((step - w) / max(total - w, 1), 0.0, 1.0)
        cosine = floor + (self.lr - floor) * 0.5 * (1.0 + cos(math.pi * progress))
        warmup = self.lr * (step + 1) / max(w, 1)
        if xp is None:
            return warmup if step < w else cosine
        return xp.where(step < w, warmup, cosine)


def init_warmup(tc: TrainConfig) -> int:
    """``--init``'s default ``warmup_steps`` for ``tc``: INIT_WARMUP_FRACTION of the schedule's steps
    (epochs with lr_per_epoch), at most INIT_WARMUP_MAX; 0 for a constant learning rate."""
    if tc.schedule == "constant":
        return 0
    return min(INIT_WARMUP_MAX, int(tc.schedule_units[1] * INIT_WARMUP_FRACTION))
