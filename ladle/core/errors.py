"""User-facing errors and the CLI wrapper that turns them into one line and exit code 2."""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable


class LadleError(Exception):
    """A problem with the user's input (path, recipe, checkpoint): says what and what to do."""


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Run a CLI entry point: bad input -> one line + exit 2, internal error -> one line + exit 1; a reader that
    closes its end of the output pipe early (``| head``) ends it quietly with exit 1.

    ``--debug`` anywhere on the command line shows the full traceback instead.
    """
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        code = int(main(args) or 0)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then answered below
        return code
    except BrokenPipeError:  # as Python's signal docs advise: no traceback, and no second error at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (LadleError, ValueError, FileNotFoundError, PermissionError) as error:
        if debug:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - the last line of defence of a CLI
        if debug:
            raise
        print(f"internal error: {type(error).__name__}: {error} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1
