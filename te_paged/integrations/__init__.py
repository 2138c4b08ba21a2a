"""Integrations with training frameworks; each submodule imports its framework lazily."""

#: The torchtitan release :mod:`te_paged.integrations.torchtitan` is tested against, and how to
#: install it next to the torch already installed (the constraint keeps pip from replacing it).
TORCHTITAN_RELEASE = "0.3.0"
TORCHTITAN_INSTALL = (
    f"pip install -c <(echo torch==<your torch version>) torchtitan=={TORCHTITAN_RELEASE} triton"
)
