"""Tools run from the repository (benchmark helpers, the documentation site's generator)."""
