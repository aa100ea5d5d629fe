"""What several commands share: user errors, device start-up, loading weights for inference and --init."""
from __future__ import annotations

from pathlib import Path

from jaxgpt.config import ModelConfig, apply_sets

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
               FloatingPointError)


def train_sets(args) -> list[str]:
    """``--set`` values, plus ``--epochs N`` as ``epochs=N``."""
    return args.set + ([f"epochs={args.epochs}"] if args.epochs else [])


def saved_train(out: str) -> dict | None:
    """The TrainConfig fields of the run in ``out`` (its newest step whose metadata reads), or None:
    no checkpoint there."""
    if not (Path(out) / "checkpoints").is_dir():
        return None
    from jaxgpt.train.checkpoint import Checkpoints, DamagedCheckpoint

    ckpts = Checkpoints(out, create=False)
    try:
        for step in reversed(ckpts.steps()):
            try:
                return ckpts.meta(step)["train"]
            except DamagedCheckpoint:
                continue
        return None
    finally:
        ckpts.close()


def run_defaults(out: str, defaults: dict) -> dict:
    """``defaults`` for a run's TrainConfig, or, where ``out`` holds a run that will resume, the values it
    started with: a default changed since then does not stop it from resuming (an explicit --set still
    must match)."""
    saved = saved_train(out) if defaults else None
    return defaults if saved is None else {k: saved[k] for k in defaults if k in saved}


def init_from(args, **flags):
    """``train --init SRC``: fine-tune the weights of a jaxgpt checkpoint, .safetensors, .pt or HF
    directory with its own tokenizer. Returns what ``prepare`` does; a rerun resumes as usual.
    ``flags``: TrainConfig fields set by flags (``--mesh``). Fine-tuning defaults over TrainConfig's:
    ``INIT_DEFAULTS`` and ``warmup_steps = init_warmup(tc)`` (jaxgpt.config.train), unless set."""
    import jax

    from jaxgpt.config.overrides import parse_sets
    from jaxgpt.config.train import INIT_DEFAULTS, init_warmup
    from jaxgpt.models import abstract_params, relayout
    from jaxgpt.convert.files import detect_format, load_weights
    from jaxgpt.train.loop import prepare
    from jaxgpt.train.step import init_state
    from jaxgpt.data.tasks import fit_config, load_task, with_epochs

    fmt = detect_format(args.init)
    config, params, extras = load_weights(args.init, fmt)
    saved = saved_train(args.out)  # a run that resumes keeps the defaults it started with, warmup included
    defaults = dict(INIT_DEFAULTS) if saved is None else {k: saved[k] for k in (*INIT_DEFAULTS, "warmup_steps")}
    config, tc = apply_sets(config, train_sets(args), defaults)
    tc = tc.replace(**flags)
    from jaxgpt.config import Execution

    params = relayout(params, config, scanned=Execution.for_model(config, tc.execution).scan_layers)  # --set exec.scan_layers
    shapes = lambda tree: jax.tree.map(lambda a: tuple(a.shape), tree)
    if shapes(abstract_params(config, tc.execution)) != shapes(params):
        raise ValueError(f"--set changes the shapes of {args.init}'s parameters; only shape-free settings "
                         "(dropout, training keys) apply to --init")
    if (Path(args.out) / "checkpoints").is_dir():
        from jaxgpt.train.checkpoint import Checkpoints

        ckpts = Checkpoints(args.out, create=False)
        saved = ckpts.latest_step() is not None
        ckpts.close()
        if saved:  # resume the fine-tuning run exactly
            return prepare(args.out, config, tc, data=args.data, corpus=args.corpus)
    tok = extras.get("tokenizer")
    if tok is None:
        raise ValueError(f"{args.init} has no tokenizer (imported weights without tokenizer.json): "
                         "it cannot encode the training data")
    if tok.get("kind") == "hf" and not isinstance(config, ModelConfig):
        raise ValueError(f"{args.init}: fine-tuning from an HF directory supports decoder LMs (GPT-2, LLaMA), "
                         f"not {type(config).__name__}")
    task = load_task(config, tc, data=args.data, corpus=args.corpus, tokenizer=tok)
    fitted = fit_config(config, task)
    if fitted != config:
        have = config.to_dict()
        diffs = [f"{k}={v!r} (the weights have {have[k]!r})" for k, v in fitted.to_dict().items() if have[k] != v]
        raise ValueError(f"{args.init} does not fit this data: it needs {', '.join(diffs)}")
    tc = with_epochs(tc, task)
    if saved is None and "warmup_steps" not in {key for key, _ in parse_sets(train_sets(args))}:
        tc = tc.replace(warmup_steps=init_warmup(tc))
    return config, tc, task, init_state(config, tc, params)


def start_devices(args) -> None:
    """Before JAX starts: join a multi-host run (jax.distributed; each process gets
    ``--mesh``'s device count / ``--num-processes`` host devices), or, on one host, give the CPU as
    many host devices as ``--mesh`` needs (also a CPU speed lever: the batch split over both cores)."""
    multi = (args.coordinator, args.num_processes, args.process_id)
    if any(v is not None for v in multi):
        if any(v is None for v in multi):
            raise ValueError("multi-host training needs --coordinator HOST:PORT, --num-processes N and "
                             f"--process-id I together; got {args.coordinator!r}, {args.num_processes!r}, "
                             f"{args.process_id!r}")
        if not 0 <= args.process_id < args.num_processes:
            raise ValueError(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")
        if args.mesh:  # each process brings its share of the mesh (on CPU hosts: that many host devices)
            from jaxgpt.parallel.sharding import mesh_devices, use_host_devices

            total = mesh_devices(args.mesh)
            if total % args.num_processes:
                raise ValueError(f"--mesh {args.mesh} spans {total} devices, which do not split evenly over "
                                 f"--num-processes {args.num_processes}; use a mesh whose size is a multiple of "
                                 f"{args.num_processes}")
            use_host_devices(total // args.num_processes)  # CPU only; a GPU/TPU host keeps its own devices
        import jax

        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    elif args.mesh:
        from jaxgpt.parallel.sharding import mesh_devices, use_host_devices

        use_host_devices(mesh_devices(args.mesh))  # CPU only; a GPU/TPU host keeps its own device count



def _is_hf_dir(path: str) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and not (p / "checkpoints").is_dir()


def load_for_inference(ckpt: str, step: int | None):
    """A jaxgpt run/checkpoint directory or a Hugging Face model directory -> (config, params, meta, tokenizer)."""
    from jaxgpt.data import tokenizer_from_dict
    from jaxgpt.train.checkpoint import Checkpoints

    if _is_hf_dir(ckpt):
        if step is not None:
            raise ValueError(f"--step {step}: {ckpt} is a Hugging Face directory, which holds one set of weights")
        from jaxgpt.convert.files import load_weights

        config, params, meta = load_weights(ckpt, "hf")  # its tokenizer.json, special ids and chat template
    else:
        config, params, meta = Checkpoints(ckpt, create=False).restore_params(step)
    tok = tokenizer_from_dict(meta["tokenizer"]) if meta.get("tokenizer") else None
    return config, params, meta, tok

