"""The `pagedserve` command. Each subcommand imports what it needs when it runs (torch only where used)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _tiny_model(args: argparse.Namespace) -> int:
    from pagedserve.tiny_model import write_tiny_model

    out = write_tiny_model(args.dir)
    print(f"wrote the tiny model to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving with PagedAttention")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("tiny-model", help="write the built-in tiny Llama checkpoint to DIR")
    p.add_argument("dir", type=Path)
    p.set_defaults(func=_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))
