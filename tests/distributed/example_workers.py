"""Worker side of tests/recipes/test_example.py: the README's example on every rank."""

import importlib.util
import os

from tests.distributed.launcher import REPO_ROOT, worker_setup

EXAMPLE = os.path.join(REPO_ROOT, "examples", "spatial_unet.py")


def load_example(source: str = None, name: str = "spatial_unet"):
    """The example as a module (from its file, or from `source`)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    if source is None:
        spec.loader.exec_module(module)
    else:
        exec(compile(source, EXAMPLE, "exec"), module.__dict__)
    return module


def run_example(epochs: int) -> list:
    """Run the example's main on this rank; its trained weights."""
    worker_setup()
    model = load_example().main(["--epochs", str(epochs)])
    return [w for w in model.get_weights()]
