"""Training: one task's loop, the launcher and its workers (local or Ray), periodic averaging and the
training curves. ``python -m ladle.train`` is this package's command."""
