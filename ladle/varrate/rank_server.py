"""What the fork server that varrate's local ranks fork from imports first (:func:`ladle.varrate.ranks.run_spawned`):
the rank code, with torch and PyG, once for every rank of every run; and the server's own parent-death signal, so that
it dies with the launcher that started it, and each rank (which asks for its parent's) with it. Nothing else imports
this module."""
from ladle.core.resources import die_with_parent
from ladle.varrate import ranks  # noqa: F401  (what every rank runs, imported before the first fork)

die_with_parent()
