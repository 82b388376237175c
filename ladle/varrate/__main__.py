"""``python -m ladle.varrate`` (also as a torchrun module): run the command line."""
from ladle.core.errors import run_cli
from ladle.varrate.cli import main

if __name__ == "__main__":
    raise SystemExit(run_cli(main))
