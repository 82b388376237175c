"""``python -m ladle.soup``."""
from ladle.core.errors import run_cli
from ladle.soup.cli import main

if __name__ == "__main__":
    raise SystemExit(run_cli(main))
