"""Tools around the library (not needed to use it): the ``tokenring`` command line (:mod:`.cli`), the
benchmark (:mod:`.bench`), the emulated-interconnect testbed (:mod:`.testbed`), the demo (:mod:`.demo`),
timelines (:mod:`.trace`), the cost-model front end (:mod:`.simulate`) and local rank launching
(:mod:`.launch`)."""

import torch

# dtype names accepted on the command lines and in benchmark specs
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["DTYPES"]
