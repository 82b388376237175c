"""Souping a run: the pipeline, the soup methods and their registry, learned soups, the evaluator, the
basin figures and the report. ``python -m ladle.soup`` is this package's command."""

import ladle.soup.learned  # noqa: E402,F401  (every method registered whatever module a caller imports first)
