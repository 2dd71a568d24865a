"""``python -m nefl_zoo.runtime bench PACKAGE``: time every tier on this device and write its
latency table (:mod:`nefl_zoo.runtime.latency`) for ``nefl-zoo select --latency-table``.

argparse only (no typer or rich): it runs where just numpy, onnxruntime and pydantic are
installed. Bad input is one ``error: ...`` line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Sequence

from ..userfiles import one_line

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one ``error:`` line (exit 2)."""

    def error(self, message: str) -> NoReturn:
        _fail(f"{message} (`{self.prog} --help` lists the options)")


def _fail(message: str) -> NoReturn:
    print(f"error: {one_line(message)}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m nefl_zoo.runtime", description="The torch-free tier runtime's commands.")
    commands = parser.add_subparsers(dest="command", required=True)  # its subparsers are _Parsers too
    bench = commands.add_parser("bench", help="time every tier on this device and write its latency table")
    bench.add_argument("package", help="an export folder or its manifest.json")
    bench.add_argument("--batch", type=_int_list, default=[1], help="comma-separated batch sizes (default: 1)")
    bench.add_argument("--runs", type=int, default=20, help="timed rounds, every entry once per round (default: 20)")
    bench.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default: 2)")
    bench.add_argument("--threads", type=int, help="onnxruntime intra-op threads (default: one per core)")
    bench.add_argument("--labels", help="comma-separated entries to time (default: all)")
    bench.add_argument("--out", help="write the table to this file (atomically)")
    bench.add_argument("--json", action="store_true", help="print the table as JSON instead of text")
    return parser


def _bench(args: argparse.Namespace) -> None:
    from .latency import check_counts, check_writable, measure_latency_table
    from .tiers import TierRuntime

    check_counts(args.batch, args.runs, args.warmup, args.threads, prefix="--")  # before the package is read
    if args.out:
        try:
            check_writable(args.out)
        except ValueError as exc:
            _fail(f"--out {exc}")
    runtime = TierRuntime(args.package, threads=args.threads)
    labels = [part.strip() for part in args.labels.split(",")] if args.labels else None
    table = measure_latency_table(runtime, args.batch, args.runs, args.warmup, labels)
    if args.out:
        try:
            table.save(args.out)
        except OSError as exc:
            _fail(f"--out {args.out}: {exc.strerror or exc}")
    if args.json:
        print(table.to_json())
        return
    threads = table.threads or "default"
    print(f"{table.model} on {table.machine.processor}: {table.runs} timed rounds after {table.warmup} warmup, {threads} threads")
    width = max(len("label"), *(len(e.label) for e in table.entries))
    print(f"{'label':<{width}}  {'batch':>5}  {'median ms':>10}  {'p95 ms':>10}")
    for e in table.entries:
        print(f"{e.label:<{width}}  {e.batch:>5}  {e.median_ms:>10.3f}  {e.p95_ms:>10.3f}")
    if args.out:
        print(f"wrote {args.out}")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``)."""
    args = _parser().parse_args(argv)
    try:
        _bench(args)
    except KeyError as exc:  # an unknown label
        _fail(str(exc.args[0]) if exc.args else "KeyError")
    except OSError as exc:
        _fail(f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}")
    except MemoryError:
        _fail("not enough memory; use a smaller --batch")
    except ValueError as exc:  # FileError (a manifest or tier file) included: one line naming the file
        _fail(str(exc))


if __name__ == "__main__":
    main()
