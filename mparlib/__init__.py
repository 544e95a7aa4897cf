"""mparlib: the shared code of the course "Data parallelism on many GPUs with PyTorch".

A notebook defines what it teaches; this package holds what several chapters reuse. The training loop is
`mparlib.train.train` (the module keeps its name: `from mparlib import train` gives the module).
"""
from .devices import num_gpus, profile, profile_line, report, require_gpus, try_all_gpus, try_gpu
from .lang import lang, tr
from .models import Residual, init_weights, resnet18
from .parallel import (AttrDataParallel, CheckpointMismatchError, data_parallel, gather, load_checkpoint,
                       parallel_apply, replicate, save_checkpoint, scatter, scatter_kwargs, state_dict_of, unwrap)
from .timing import Accumulator, Timer

__version__ = "0.1.0"
