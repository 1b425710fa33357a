"""The kit's version (pyproject.toml's ``version``), in a module of its own: the grading wing reads it in
nbgrader's steps, which load the wing without the kit's ``__init__`` (and so without torch:
``grading/startup.py``)."""

__version__ = "0.1.0"
