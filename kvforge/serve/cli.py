"""``kvforge serve``: argument parsing, engine construction and the server's main loop.

Every value is checked by argparse (a bad one is a one-line usage error, exit status 2); the engine's own
config classes check them again and their ``ValueError`` is reported the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from kvforge.service.cli import _endpoint, _int_at_least, _port

if TYPE_CHECKING:
    from kvforge.engine import EngineConfig

__all__ = ["DESCRIPTION", "add_arguments", "build", "run"]

DESCRIPTION = (
    "Serve a kvforge engine (random weights) over an OpenAI-compatible HTTP API: /v1/completions and "
    "/v1/chat/completions (streaming or not; token-id prompts, or text and chat with --tokenizer), /v1/models, "
    "/health and /metrics (Prometheus, with the prefix-hit counters). One background thread steps the engine; "
    "requests join and leave between steps, and a client that disconnects aborts its request. With "
    "--kv-events-endpoint the cache's block events (stored, removed, cleared) are published in vLLM's ZMQ wire "
    "format, so `kvforge router --kv-events` (or any vLLM-event consumer) follows this engine's cache."
)


def _planted(text: str) -> int:
    v = _int_at_least(1)(text)
    if v >= 64:
        raise argparse.ArgumentTypeError(f"expected an integer in 1..63, got {v}")
    return v


def _name(text: str) -> str:
    if not text or len(text) > 256 or any(c.isspace() or ord(c) < 32 for c in text):
        raise argparse.ArgumentTypeError(f"expected a non-empty name without spaces, got {text!r:.80}")
    return text


def _device(text: str) -> str:
    if text not in ("auto", "cpu") and not (text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit())):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r:.80}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (random weights)")
    g.add_argument(
        "--model",
        choices=("tiny", "real"),
        default="tiny",
        help="tiny: 4 layers of width 64 (CPU, the Triton interpreter); real: about 2.9 B parameters (a GPU) "
        "(default tiny)",
    )
    g.add_argument(
        "--planted",
        type=_planted,
        default=0,
        metavar="K",
        help="plant the copy head: logits peak at the token K positions back, so greedy outputs are decisive "
        "(tiny widens to hidden size 128 for it; default 0: all weights random)",
    )
    g.add_argument("--seed", type=_int_at_least(0), default=0, help="weight seed (default 0)")
    g.add_argument(
        "--vocab-size",
        type=_int_at_least(2),
        default=None,
        help="model vocabulary (default: the tokenizer's size with --tokenizer, else the model's: 256 / 32768)",
    )
    g.add_argument(
        "--served-model-name",
        type=_name,
        default=None,
        help="the id /v1/models lists and requests must name (default: the --model value)",
    )
    g.add_argument("--device", type=_device, default="auto", help="auto (CUDA when present), cpu, cuda[:N]")
    g.add_argument(
        "--draft-len", type=int, choices=(0, 1), default=0, help="speculative tokens per step (drafter; default 0)"
    )
    g.add_argument(
        "--tokenizer",
        metavar="tokenizer.json",
        help="a local tokenizers file: text prompts and chat (rendered as kvforge router keys them) are encoded "
        "with it and outputs decoded (default: token-id prompts only)",
    )
    g = p.add_argument_group("cache and scheduler")
    g.add_argument("--tokens-per-block", type=_int_at_least(1), default=16, help="tokens per KV block (default 16)")
    g.add_argument("--attention-pages", type=_int_at_least(1), default=512, help="MLA latent pages (default 512)")
    g.add_argument("--draft-pages", type=_int_at_least(1), default=512, help="drafter latent pages (default 512)")
    g.add_argument(
        "--state-pages",
        type=_int_at_least(1),
        default=128,
        help="recurrent-state pages: live states and snapshots (default 128)",
    )
    g.add_argument("--max-num-tokens", type=_int_at_least(1), default=512, help="token budget per step (default 512)")
    g.add_argument("--max-num-requests", type=_int_at_least(1), default=16, help="requests per step (default 16)")
    g.add_argument(
        "--max-blocks-per-request",
        type=_int_at_least(1),
        default=128,
        help="longest request in blocks, prompt + output (default 128)",
    )
    g.add_argument(
        "--snapshot-interval",
        type=_int_at_least(0),
        default=0,
        help="recurrent snapshot every N tokens for prefix reuse (0: at prompt ends only; default 0)",
    )
    g.add_argument("--no-reuse", action="store_true", help="turn prefix reuse off (every request its own scope)")
    g.add_argument(
        "--context-16bit",
        action="store_true",
        help="context attention reads 16-bit Q/K/V instead of FP8 e4m3 (default FP8)",
    )
    g = p.add_argument_group("KV events (vLLM wire format)")
    g.add_argument(
        "--kv-events-endpoint",
        type=_endpoint,
        default=None,
        metavar="ENDPOINT",
        help="ZMQ PUB endpoint to bind, e.g. tcp://*:5557 (default: no events)",
    )
    g.add_argument(
        "--kv-replay-endpoint",
        type=_endpoint,
        default=None,
        metavar="ENDPOINT",
        help="ZMQ ROUTER endpoint to bind for replays of missed batches, e.g. tcp://*:5558",
    )
    g.add_argument("--kv-topic", default="", help="topic of the published messages (default '')")
    g.add_argument(
        "--kv-buffer-steps", type=_int_at_least(1), default=10_000, help="batches kept for replay (default 10000)"
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    g.add_argument("--port", type=_port, default=8000, help="listen port (default 8000)")
    g.add_argument(
        "--max-tokens-default",
        type=_int_at_least(1),
        default=16,
        help="max_tokens of a request that names none (default 16)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=_int_at_least(1),
        default=16 * 2**20,
        help="largest request body; larger ones get 413 (default 16 MiB)",
    )
    g.add_argument(
        "--instance-name",
        type=_name,
        default=None,
        help="this server's name in each response's system_fingerprint (default HOST:PORT)",
    )
    g.add_argument(
        "--step-log",
        default=None,
        metavar="PATH",
        help="append one JSON line per engine step (monotonic start/end, prefill chunks, decode rows and context) to "
        "PATH, '{instance}' replaced by --instance-name; for comparing real steps with a step profile (default off)",
    )
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up request run before the server listens")
    g.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info", help="default info")
    g.add_argument("--log-format", choices=("json", "text"), default="json", help="default json")


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(EngineLoop, ServeApp)`` from parsed arguments (the loop not started); raises ValueError / OSError."""
    import torch

    import kvforge.kernels  # noqa: F401  (turns on the Triton interpreter without a GPU)
    from kvforge.engine import Engine, HybridModel, real, tiny
    from kvforge.serve.app import ServeApp, ServeSettings
    from kvforge.serve.loop import EngineLoop

    if args.kv_replay_endpoint is not None and args.kv_events_endpoint is None:
        raise ValueError("--kv-replay-endpoint: given without --kv-events-endpoint")
    step_log = None
    if args.step_log is not None:
        path = args.step_log.replace("{instance}", args.instance_name or f"{args.host}_{args.port}")
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"--step-log: {path!r}: its folder does not exist")
    vocab = args.vocab_size
    if args.tokenizer is not None:
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(args.tokenizer)
        except Exception as exc:  # tokenizers raises a bare Exception for a bad file
            raise ValueError(f"--tokenizer: cannot load {args.tokenizer!r} as a tokenizer.json: {exc}") from None
        n = tok.get_vocab_size()
        if vocab is None:
            vocab = n
        elif vocab < n:
            raise ValueError(f"--vocab-size: {vocab} is smaller than the tokenizer's {n} tokens")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device: {device} asked for, but no CUDA device is available")
    kw: dict[str, Any] = {"seed": args.seed}
    if vocab is not None:
        kw["vocab_size"] = vocab
    if args.planted:
        kw["copy_offset"] = args.planted
        if args.model == "tiny":
            kw["hidden_size"] = 128  # the copy head's codes need width // 4 >= 32 (as the engine tests use)
    if args.draft_len == 0:
        kw["draft_layers"] = 0
    mc = (real if args.model == "real" else tiny)(**kw)
    model = HybridModel(mc, device=device)
    ec = engine_config(args, device)
    engine = Engine(model, ec, draft_len=args.draft_len)
    if not args.no_warmup:
        # The first steps pay one-time costs (kernel compilation, allocator growth): pay them before /health
        # answers 200. A prompt shorter than a block leaves no full block, so no event is missed.
        engine.generate({"kvforge-warmup": [0] * max(1, min(3, args.tokens_per_block - 1))}, 2)
        engine.outputs.clear()
        engine.finished.clear()
        if engine.graphs is not None:
            # Every decode batch bucket now: a bucket's first use would capture it inside a live step, far longer
            # than a step (and than the step-time profile, which captures them all before timing).
            engine.graphs.capture_all()
    if args.step_log is not None:
        try:
            # Line-buffered: each step's line is on disk at once (a killed server loses none).
            step_log = open(path, "a", buffering=1)  # noqa: SIM115  (closed by EngineLoop.stop)
        except OSError as exc:
            raise ValueError(f"--step-log: cannot open {path!r}: {exc.strerror}") from None
    publisher = None
    if args.kv_events_endpoint is not None:
        from kvforge.service.kv_events import KVEventPublisher

        publisher = KVEventPublisher(
            args.kv_events_endpoint, args.kv_replay_endpoint, topic=args.kv_topic, buffer_steps=args.kv_buffer_steps
        )
    loop = EngineLoop(engine, publisher, step_log=step_log)
    settings = ServeSettings(
        model_name=args.served_model_name or args.model,
        tokenizer=args.tokenizer,
        default_max_tokens=args.max_tokens_default,
        max_body_bytes=args.max_body_bytes,
        instance=args.instance_name or f"{args.host}:{args.port}",
    )
    return loop, ServeApp(loop, settings)


def engine_config(args: argparse.Namespace, device: str) -> EngineConfig:
    """The ``EngineConfig`` that ``kvforge serve`` runs with these parsed flags (bench/profile_step_time.py
    profiles the same one)."""
    from kvforge.engine import EngineConfig

    return EngineConfig(
        tokens_per_block=args.tokens_per_block,
        attention_pages=args.attention_pages,
        draft_pages=args.draft_pages,
        state_pages=args.state_pages,
        max_num_tokens=args.max_num_tokens,
        max_num_requests=args.max_num_requests,
        max_blocks_per_request=args.max_blocks_per_request,
        snapshot_interval=args.snapshot_interval,
        reuse=not args.no_reuse,
        context_fp8=not args.context_16bit,
        device=device,
    )


def run(args: argparse.Namespace) -> int:
    try:
        from aiohttp import web

        from kvforge.service.metrics import configure_logging
    except ImportError as exc:
        print(f"kvforge serve: error: {exc.name} is missing; install kvforge[router,engine]", file=sys.stderr)
        return 1
    try:
        loop, app = build(args)
    except ImportError as exc:
        print(f"kvforge serve: error: {exc.name} is missing; install kvforge[router,engine]", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as exc:
        print(f"kvforge serve: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # zmq bind errors and the like: one line, no traceback
        print(f"kvforge serve: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    configure_logging(args.log_level, args.log_format)
    import gc
    import logging

    # The model, the engine's buffers and the warm-up's leftovers live as long as the process: out of the cyclic
    # collector's sight, a full collection (0.24 s in bench/probe_engine_host_cost.py's batch-256 run) no
    # longer walks them between steps.
    gc.freeze()
    fields = {
        "host": args.host,
        "port": args.port,
        "model": app.settings.model_name,
        "device": str(loop.engine.model.device),
        "kv_events": None if loop.publisher is None else loop.publisher.endpoint,
        "kv_replay": None if loop.publisher is None else loop.publisher.replay_endpoint,
    }
    logging.getLogger("kvforge.serve").info("serve listening", extra={"fields": fields})
    loop.start()
    try:
        web.run_app(
            app.make_app(), host=args.host, port=args.port, access_log=None, print=None, handler_cancellation=True
        )
    except OSError as exc:
        print(f"kvforge serve: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    finally:
        loop.stop()
    return 0
