"""The startup floor: the least a DDP job must do before its first step finishes.

Imports torch, initialises gloo from the launcher's environment (torchrun or Open MPI), builds
the same Llama as the fsdp_tp trainer, wraps it in DDP and runs one AdamW step. Rank 0 writes
``{"first_step_time": <epoch s>, "launch_time": ..., "startup_s": ...}`` to the path given as its
one argument; ``MMM_LAUNCH_TIME`` (set by the caller before it starts the launcher) is time zero.
No mmm code runs except the model class (a plain nn.Module). Used by benchmarks/startup.py.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from mmm.models.llama import Llama, LlamaConfig


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line: usage is one --help away
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main() -> None:
    env = os.environ
    p = _Parser(
        prog="benchmarks/startup_floor.py",
        description=__doc__.split("\n\n")[0],
        epilog="Run it under torchrun or mpiexec, as benchmarks/startup.py does. FLOOR_DIM, FLOOR_LAYERS, FLOOR_SEQ "
        "and FLOOR_BATCH set the model and the global batch [256, 4, 128, 16].",
    )
    p.add_argument("out", metavar="OUT.json", help="where rank 0 writes the first step's time")
    out = p.parse_args().out
    try:
        float(env["MMM_LAUNCH_TIME"])
    except (KeyError, ValueError):
        p.error("MMM_LAUNCH_TIME must be the launch's epoch time in s (e.g. MMM_LAUNCH_TIME=$(date +%s.%N))")
    if "MASTER_ADDR" not in env:
        p.error("MASTER_ADDR is not set: run it under torchrun or mpiexec -x MASTER_ADDR -x MASTER_PORT")
    rank = int(env.get("RANK", env.get("OMPI_COMM_WORLD_RANK", 0)))
    world = int(env.get("WORLD_SIZE", env.get("OMPI_COMM_WORLD_SIZE", 1)))
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", 1)))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        dim=int(env.get("FLOOR_DIM", 256)),
        n_layers=int(env.get("FLOOR_LAYERS", 4)),
        seq_len=int(env.get("FLOOR_SEQ", 128)),
    )
    model = DistributedDataParallel(Llama(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = int(env.get("FLOOR_BATCH", 16)) // world
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    loss_value = loss.item()
    done = time.time()
    if rank == 0:
        launch = float(env["MMM_LAUNCH_TIME"])
        with open(out, "w") as f:
            json.dump(
                {"first_step_time": done, "launch_time": launch, "startup_s": done - launch, "loss": loss_value}, f
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
