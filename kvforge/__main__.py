"""``python -m kvforge`` / ``kvforge``: command-line entry point.

Subcommands:
  selfcheck   run every kernel against its reference on this machine (the Triton interpreter without a GPU)
"""

from __future__ import annotations

import argparse
import sys


def _selfcheck(args: argparse.Namespace) -> int:
    import kvforge.kernels  # noqa: F401  (turns on the interpreter when there is no GPU)
    from kvforge.kernels._runtime import interpreting, kernel_device
    from kvforge.kernels._selfcheck import format_table, run_all

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvforge", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("selfcheck", help="check every kernel against its reference")
    p.set_defaults(func=_selfcheck)
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["selfcheck", *(argv or [])])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
