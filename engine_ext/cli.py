"""The `dynsteer` command line.

Each top-level command is added to the parser by one registrar function in `_COMMANDS`, which
sets the `handler` that runs it; a later command (e.g. `serve`) lives in its own module and only
adds its registrar there. Handlers return the exit code. Results go to stdout and nothing else
does, so that scripts can use them (`MODEL=$(dynsteer model path)`); progress and errors go to
stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from .default_model import ModelUnavailableError, default_model_path
from .server.cli import add_serve_command, run_serve

EXIT_UNAVAILABLE = 2


def add_model_command(commands: argparse._SubParsersAction) -> None:
    """Register `dynsteer model ...`: the embedded default model."""
    model = commands.add_parser("model", help="the embedded default model (SmolLM2-135M-Instruct)")
    actions = model.add_subparsers(dest="action", required=True, metavar="ACTION")
    path = actions.add_parser(
        "path", help="print the model's folder, converting it from the shipped GGUF on first use"
    )
    path.set_defaults(handler=run_model_path)


def run_model_path(args: argparse.Namespace) -> int:
    """Print the default model's folder and nothing else on stdout; exit 2 if it cannot be made."""
    try:
        path = default_model_path()
    except (ModelUnavailableError, OSError) as error:  # OSError: e.g. an unwritable cache dir
        print(f"dynsteer: error: cannot prepare the default model: {error}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    print(path)
    return 0


def add_controller_command(commands: argparse._SubParsersAction) -> None:
    """Register `dynsteer controller run ...`: an asynchronous controller. Its arguments are
    parsed by the controller module itself, which is imported only when the command runs."""
    controller = commands.add_parser("controller", help="asynchronous controllers")
    actions = controller.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = actions.add_parser(
        "run", add_help=False, prefix_chars="\0",  # every argument, --help too, goes to argv
        help="run an AsyncController subclass against an engine's event and command sockets",
    )
    run.add_argument("argv", nargs=argparse.REMAINDER)
    run.set_defaults(handler=run_controller)


def run_controller(args: argparse.Namespace) -> int:
    """Hand the arguments to the controller's own parser (no vLLM import on this path)."""
    from dynsteer.controller.async_controller import main as controller_main

    return controller_main(args.argv)


_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_model_command,
    add_serve_command,
    add_controller_command,
)


def build_parser() -> argparse.ArgumentParser:
    """The full `dynsteer` parser, one subcommand per registrar in `_COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="dynsteer", description="Dynamic, activation-conditioned steering for vLLM."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in _COMMANDS:
        register(commands)
    return parser


def _log_progress_to_stderr() -> None:
    """Show dynsteer's progress messages (INFO and up) on stderr, leaving stdout to results."""
    logger = logging.getLogger("dynsteer")
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("dynsteer: %(message)s"))
        logger.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dynsteer` console script; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # vLLM's flags: passed through, not parsed here
        _log_progress_to_stderr()
        return run_serve(argv[1:])
    args = build_parser().parse_args(argv)
    _log_progress_to_stderr()
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
