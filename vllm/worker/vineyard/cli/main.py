# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The command line of ``vineyard-llm-cache`` (:func:`build_parser`) and
its entry point (:func:`main`): exit codes, usage errors."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from vllm.worker.vineyard.cli.arguments import UsageError, number, parse_size
from vllm.worker.vineyard.cli.evict import cmd_evict
from vllm.worker.vineyard.cli.ls import cmd_ls
from vllm.worker.vineyard.cli.purge import cmd_purge
from vllm.worker.vineyard.cli.settings import cmd_settings
from vllm.worker.vineyard.cli.verify import cmd_verify

PROG = "vineyard-llm-cache"

Command = Callable[[argparse.Namespace, TextIO], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="See, check and steer a vineyard LLM cache root. Touches "
        "only the cache's own files; runs beside live instances.",
        epilog="Exit codes: 0 done, 1 verify found bad chunks, 2 usage error.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, run: Command) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("root", metavar="ROOT", help="the cache root")
        p.add_argument(
            "--json", action="store_true", help="one JSON document on stdout"
        )
        p.set_defaults(run=run)
        return p

    command(
        "ls", "namespaces, their size and last use; what is not the cache's", cmd_ls
    )
    _verify_arguments(
        command(
            "verify",
            "read every chunk and verify every entry as a load does",
            cmd_verify,
        )
    )
    _purge_arguments(
        command("purge", "delete namespaces (all their chunks)", cmd_purge)
    )
    _evict_arguments(
        command("evict", "evict least recently used chunks down to a size", cmd_evict)
    )
    _settings_arguments(
        command(
            "settings",
            "show or change the root's own disk limit and TTL, which govern "
            "every instance's sweeps of it",
            cmd_settings,
        )
    )
    return parser


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--key-file",
        metavar="F",
        help="the secret of the instances' VINEYARD_CACHE_AUTH_KEY_FILE "
        "(namespaces sealed with another key are skipped)",
    )
    p.add_argument("--remove", action="store_true", help="delete bad chunks")
    p.add_argument(
        "--rate-mb-s",
        type=number(zero_allowed=False),
        metavar="R",
        help="read at most R MiB/s (to run beside live instances)",
    )


def _purge_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", metavar="N", help="a namespace (see `ls`)")
    which.add_argument(
        "--model",
        metavar="M",
        help="every namespace of this model (as served, or as `ls` names it)",
    )
    p.add_argument("--dry-run", action="store_true", help="only say what would go")


def _evict_arguments(p: argparse.ArgumentParser) -> None:
    _size_argument(p, "--to", "bytes of chunks to keep at most", required=True)
    p.add_argument("--dry-run", action="store_true", help="only say what would go")


def _settings_arguments(p: argparse.ArgumentParser) -> None:
    _size_argument(p, "--disk-limit", "most bytes of chunks on the root")
    p.add_argument(
        "--ttl-s",
        type=number(zero_allowed=True),
        metavar="S",
        help="seconds after its last use when a chunk expires (0: never)",
    )


def _size_argument(
    p: argparse.ArgumentParser, flag: str, what: str, required: bool = False
) -> None:
    p.add_argument(
        flag,
        type=parse_size,
        required=required,
        metavar="SIZE",
        help=f"{what}: 500M, 10G, 1.5T (binary units)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else 2
    try:
        return int(args.run(args, sys.stdout))
    except UsageError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. piped into `head`
        return 0
