"""``python -m ladle.train``."""
from ladle.core.errors import run_cli
from ladle.train.cli import main

if __name__ == "__main__":
    raise SystemExit(run_cli(main))
