"""A device without torch: run the runtime's bench where importing torch (or the host-only
packages) fails loudly, so that code which imports them, even inside a try, is caught."""

import subprocess
import sys

# What a device with only numpy, onnxruntime and pydantic lacks: importing any of it fails
# loudly (the marker line on stderr), so a bench that imports torch, even in a try, is caught.
NOT_ON_DEVICE = ("torch", "torchvision", "onnx", "typer", "click", "rich", "yaml")
BLOCK = f"""
import importlib.abc, sys
class NotOnDevice(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {NOT_ON_DEVICE!r}:
            sys.stderr.write("BLOCKED import of " + name + "\\n")
            raise ImportError("not installed on the device: " + name)
sys.meta_path.insert(0, NotOnDevice())
"""
RUN_BENCH = BLOCK + "import runpy; runpy.run_module('nefl_zoo.runtime', run_name='__main__', alter_sys=True)"


def bench(*args, cwd=None):
    return subprocess.run([sys.executable, "-c", RUN_BENCH, "bench", *map(str, args)], capture_output=True, text=True, cwd=cwd)
