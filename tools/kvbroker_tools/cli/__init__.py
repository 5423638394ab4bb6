"""The commands the tools add to ``kvbroker``: ``up`` and ``demo`` (``stack``) and
``bench`` (``bench``), registered under the ``kvbroker.commands`` entry points in
tools/pyproject.toml, which ``kvbroker.cli.main`` loads."""
