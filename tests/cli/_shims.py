"""A PYTHONPATH entry that hides torch from every Python started with it, as an installation
without torch would: its `sitecustomize` refuses the import (and `find_spec`)."""

import os

HIDE_TORCH = """
import importlib.abc
import sys


class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
"""


def pythonpath_without_torch(tmp_path) -> str:
    """PYTHONPATH (the current one after it) under which `import torch` fails."""
    shim = tmp_path / "no_torch"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(HIDE_TORCH)
    return os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))
