"""``python -m kvforge`` / ``kvforge``: command-line entry point (``simulate`` is the default subcommand).

The parser's texts are plain text (``DESCRIPTION``), since ``--help`` prints them as they are.
"""

from __future__ import annotations

import argparse
import sys


def _selfcheck(args: argparse.Namespace) -> int:
    try:
        import kvforge.kernels  # noqa: F401  (turns on the interpreter when there is no GPU)
        from kvforge.kernels._runtime import interpreting, kernel_device
        from kvforge.kernels._selfcheck import format_table, run_all
    except ImportError as exc:  # the light install: no torch / Triton
        print(
            f"kvforge selfcheck: error: the kernels need torch and Triton ({exc}); pip install 'kvforge[kernels]'",
            file=sys.stderr,
        )
        return 2

    device = kernel_device()
    mode = "Triton interpreter (CPU)" if interpreting() else f"GPU {device}"
    print(f"kvforge self-check on {mode}")
    rows = run_all(device)
    print(format_table(rows))
    failed = [r for r in rows if not r.passed]
    if not rows:
        print("no kernel checks found", file=sys.stderr)
        return 1
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _simulate(args: argparse.Namespace) -> int:
    from kvforge.sim.cli import run_safely

    return run_safely(args)


def _add_router(sub: argparse._SubParsersAction) -> None:
    from kvforge.service.cli import DESCRIPTION, add_arguments, run

    p = sub.add_parser("router", help="OpenAI-compatible routing proxy in front of engines", description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from kvforge.serve.cli import DESCRIPTION, add_arguments, run

    p = sub.add_parser("serve", help="one engine behind an OpenAI-compatible HTTP server", description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)


DESCRIPTION = """kvforge: kernels, KV caches, schedulers and routers for hybrid-attention LLM serving.

subcommands:
  simulate    (the default) trace-driven serving simulator: router -> schedulers -> cache managers, in
              simulated time; with no arguments it runs the embedded synthetic workload
              (see: kvforge simulate --help)
  selfcheck   run every kernel against its reference on this machine (the Triton interpreter without a GPU)
  router      the conversation router as an OpenAI-compatible HTTP proxy in front of a fleet of engines
              (see: kvforge router --help)
  serve       one kvforge engine (random weights) behind an OpenAI-compatible HTTP server, publishing its
              KV events in vLLM's format (see: kvforge serve --help)
"""


def _version() -> str:
    """The installed distribution's version, else the source tree's."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("kvforge")
    except PackageNotFoundError:
        from kvforge import __version__

        return __version__


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr and exit status 2 (no usage dump, no traceback). No prefix matching:
    ``--server 8`` is an error, not ``--servers 8`` (subcommand parsers are built by this class too)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    from kvforge.sim.cli import DESCRIPTION as SIM_DESCRIPTION
    from kvforge.sim.cli import add_arguments

    parser = _Parser(prog="kvforge", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvforge {_version()}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    p = sub.add_parser(
        "simulate", help="trace-driven serving simulator (the default command)", description=SIM_DESCRIPTION
    )
    add_arguments(p)
    p.set_defaults(func=_simulate)
    p = sub.add_parser(
        "selfcheck",
        help="check every kernel against its reference",
        description="Run every kernel against its plain-torch reference on this machine and print a table.",
    )
    p.set_defaults(func=_selfcheck)
    _add_router(sub)
    _add_serve(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        # No subcommand: the main job, simulate, with whatever options were given.
        argv = ["simulate", *argv]
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
