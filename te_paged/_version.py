"""The one place te_paged's version is written (read by pyproject.toml, ``te_paged.__version__``
and ``te-paged --version``)."""

__version__ = "0.1.0"
