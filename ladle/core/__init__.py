"""The ground floor: recipes, the run directory, atomic storage, weight arithmetic, errors, resources and
the byte convention of collectives. Imports nothing else of ladle."""
