"""``jaxgpt serve MODEL``: an OpenAI-compatible server (docs/serving.md)."""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

from jaxgpt.cli.common import load_for_inference


def chat_template_of(model: str, tokenizer=None) -> str | None:
    """The chat template served: the tokenizer's (an HF directory's, or the one a run fine-tuned from
    one carries), else the directory's chat_template.jinja or tokenizer_config.json's 'chat_template'."""
    from jaxgpt.data.hf_tokenizer import carried_files, chat_template_in

    return getattr(tokenizer, "chat_template", None) or chat_template_in(carried_files(model))


def spec_max_batch(text: str):
    """--spec-max-batch: 'auto' or an int >= 1 (argparse prints the error's message)."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int >= 1 (requests running), got {text!r}")
    return n


def build_engine(args):
    """(engine, tokenizer, model name) from the parsed arguments."""
    from jaxgpt.config import ModelConfig
    from jaxgpt.inference.engine import Engine

    config, params, meta, tok = load_for_inference(args.model, None)
    if not isinstance(config, ModelConfig) or meta.get("kind", "lm") not in ("lm",):
        raise ValueError(f"{args.model} is not a decoder language model; `jaxgpt serve` serves GPT-2/LLaMA-style "
                         "models")
    eos = getattr(tok, "eos_ids", None) or ([tok.eos_id] if getattr(tok, "eos_id", None) is not None else [])
    max_model_len = getattr(args, "max_model_len", None)  # getattr: callers' Namespaces may predate a flag
    kw = dict(max_seqs=args.max_seqs, page_size=args.page_size, num_pages=args.num_pages,
              max_tokens_per_step=args.max_tokens_per_step, kv_dtype=args.kv_dtype, eos_ids=eos,
              decode=tok.decode if tok is not None else None, max_model_len=max_model_len,
              enable_prefix_caching=getattr(args, "prefix_caching", True))
    dconfig = None
    if args.draft:
        dconfig, dparams, dmeta, _ = load_for_inference(args.draft, None)
        if not isinstance(dconfig, ModelConfig) or dmeta.get("kind", "lm") != "lm":
            raise ValueError(f"--draft {args.draft} is not a decoder language model")
        kw.update(draft=(dconfig, dparams), num_speculative_tokens=args.num_speculative_tokens)
        if getattr(args, "spec_max_batch", None) is not None:
            kw.update(spec_max_batch=args.spec_max_batch)
    if getattr(args, "kv_cache_memory", None) is not None:
        from jaxgpt.inference.paged_cache import pages_for_budget

        kw["num_pages"] = pages_for_budget(config, args.page_size, args.kv_dtype, args.kv_cache_memory,
                                           max_model_len=max_model_len, draft_config=dconfig)
    engine = Engine(config, params, **kw)
    name = args.served_model_name or Path(args.model.rstrip("/")).name
    return engine, tok, name


def cmd_serve(args) -> int:
    try:
        import uvicorn
    except ImportError:
        raise ValueError("jaxgpt serve needs FastAPI and uvicorn: pip install 'jaxgpt[serve]'") from None
    from jaxgpt.inference.server import create_app
    from jaxgpt.inference.server_limits import uvicorn_protocol
    from jaxgpt.inference.server_ops import install

    engine, tok, name = build_engine(args)
    if args.precompile:  # every shape the engine can run, before the first request waits on one
        t0 = time.perf_counter()
        print(f"jaxgpt serve: compiling {len(engine.buckets())} engine shapes ...", file=sys.stderr, flush=True)
        engine.precompile()
        print(f"jaxgpt serve: compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    limits = serve_limits(args)
    app = create_app(engine, tokenizer=tok, model_name=name, chat_template=chat_template_of(args.model, tok),
                     max_waiting=args.max_waiting, limits=limits)
    install(app, api_key=args.api_key or os.environ.get("JAXGPT_API_KEY") or None,
            request_timeout=args.request_timeout, access_log=args.access_log)

    class Server(uvicorn.Server):
        """uvicorn re-raises a SIGTERM/SIGINT once its graceful shutdown is done, so the process
        would die by the signal (exit 143); a shutdown that went as asked exits 0 instead."""

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    # The weights, compiled programs and libraries live as long as the server, and a full collection that
    # walked them paused every stream (docs/serving.md has the figures): frozen, the collector walks only
    # the objects requests create.
    gc.collect()
    gc.freeze()
    print(f"jaxgpt serve: {name} on http://{args.host}:{args.port} ({engine.allocator.total} KV pages, "
          f"max_model_len {engine.max_model_len})", file=sys.stderr, flush=True)
    # SIGTERM: stop accepting, let in-flight requests finish for --shutdown-timeout s, cancel the
    # rest (their handlers abort their engine requests), then the lifespan closes the EngineLoop
    Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", http=uvicorn_protocol(limits),
                          timeout_keep_alive=args.timeout_keep_alive,
                          timeout_graceful_shutdown=args.shutdown_timeout)).run()
    left = list(engine.requests)
    for rid in left:  # aborts the engine thread had no time to run: every page back on the free list
        engine.abort(rid)
    print(f"jaxgpt serve: shut down ({len(left)} unfinished requests cancelled)", file=sys.stderr, flush=True)
    return 0


def serve_limits(args):
    """The ServeLimits of the --max-* and --*-timeout flags (a flag left out: the field's default)."""
    from dataclasses import fields

    from jaxgpt.inference.server_limits import ServeLimits

    return ServeLimits(**{f.name: getattr(args, f.name) for f in fields(ServeLimits)
                          if getattr(args, f.name, None) is not None})


def add_limit_flags(s) -> None:
    """Bounds on what a client sends (docs/serving.md, Limits); defaults: ServeLimits'."""
    from jaxgpt.inference.server_limits import ServeLimits

    d = ServeLimits()
    g = s.add_argument_group("limits on what a client sends (docs/serving.md)")
    for flag, kind, what in (
            ("max-request-bytes", int, "request body bytes (413 past it)"),
            ("max-header-bytes", int, "request line and header bytes (431 past it)"),
            ("max-json-depth", int, "nesting of arrays and objects in a body (400 past it)"),
            ("max-prompts", int, "prompts in one /v1/completions request"),
            ("max-messages", int, "messages in one chat request"),
            ("max-prompt-chars", int, "characters of one prompt string or one chat message's content"),
            ("max-stop-chars", int, "characters of each stop string"),
            ("max-stop-token-ids", int, "entries of stop_token_ids"),
            ("max-user-chars", int, "characters of user"),
            ("header-timeout", float, "seconds a request's head may take from its first byte (then closed)"),
            ("body-timeout", float, "seconds a request's body may take to arrive (408, closed)"),
            ("send-timeout", float, "seconds a client may leave a response unread (then cut off, its requests "
                                    "aborted)")):
        default = getattr(d, flag.replace("-", "_"))
        g.add_argument(f"--{flag}", type=kind, metavar="N" if kind is int else "S", help=f"{what} [{default}]")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="S",
                   help="seconds an idle keep-alive connection is held (uvicorn's) [5]")


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible server (paged KV cache, continuous batching)")
    s.add_argument("model", help="HF model directory or jaxgpt run/checkpoint directory")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-seqs", type=int, default=32, help="requests decoded together")
    s.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    pages = s.add_mutually_exclusive_group()
    pages.add_argument("--num-pages", type=int, help="KV pages (default: max-seqs full contexts)")
    pages.add_argument("--kv-cache-memory", metavar="SIZE",
                       help="KV pages to fill this memory: a size (4GiB, 512MiB) or a fraction of the device's "
                            "memory (0.3); the draft's pools count too")
    s.add_argument("--max-model-len", type=int, help="longest prompt + output served (default: the model's context)")
    s.add_argument("--max-tokens-per-step", type=int, default=512, help="token budget of one engine step")
    s.add_argument("--max-waiting", type=int, default=256, help="queued requests before answering 429")
    s.add_argument("--no-precompile", dest="precompile", action="store_false",
                   help="start at once and compile each shape on its first use (requests then wait on it)")
    s.add_argument("--kv-dtype", choices=("auto", "float32", "bfloat16", "int8"), default="auto")
    s.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not reuse the KV pages of prompt prefixes other requests computed (docs/serving.md)")
    s.add_argument("--draft", help="draft model for speculative decoding (same vocabulary)")
    s.add_argument("--num-speculative-tokens", type=int, default=4, help="draft tokens proposed a round")
    s.add_argument("--spec-max-batch", type=spec_max_batch, metavar="auto|N",
                   help="auto (the default): speculate where the measured acceptance and call times say a round "
                        "pays at the batch's size; N: speculate while at most N requests run")
    s.add_argument("--served-model-name", help="the model id clients send (default: the directory's name)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' under /v1 (default: $JAXGPT_API_KEY)")
    s.add_argument("--request-timeout", type=float, help="seconds a request may run (504, or a stream's last "
                                                         "event is the error; its pages are freed)")
    s.add_argument("--access-log", metavar="PATH", help="one JSON line per request to PATH ('-': stdout)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests may finish before they are cancelled")
    add_limit_flags(s)
    s.set_defaults(fn=cmd_serve)
